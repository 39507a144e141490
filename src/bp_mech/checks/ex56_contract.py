"""Contract checks of exercises/ex56_continual_pretrain.py: the whole promise, explored (``properties.explore``).

* ``token_loss``: float64 reference on drawn bigram tables and batches; the model and batches unmodified, a
  non-contiguous logits view, logits of magnitude 1e3, an all-ignored batch, a Python float, the model's own
  exception passed through.
* ``ReplayStream``: against a reference drawn row by row from the docstring's rule (floor((g + 1) q) >
  floor(g q), integer arithmetic) on copies of the two streams; its state is a copy, resumes bit for bit in
  a stream of other seeds, and ``load_state_dict`` keeps no reference; bad arguments raise ValueError.
* ``predict_replay_tokens``: measured by drawing the batches of that reference mix and counting the tokens
  that came from the old text (its ids start at ``OLD``; exact: a count).
"""

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import assert_value, call
from bp_mech.checks.properties import (
    assert_finite,
    assert_type,
    call_unmodified,
    explore,
    strided,
)

TOL, TOL_EXTREME = 1e-6, 1e-5  # float32 logits summed per batch; at |logits| ~ 1e3 the float32 log-sum-exp
OLD = 10_000  # the old text's token ids start here: a row's first id tells its domain


class _Bigram(torch.nn.Module):
    """logits[b, t] = table[x[b, t]], returned as a view laid out ``how`` ("slice", "transpose") or contiguous."""

    def __init__(self, vocab: int, seed: int, scale: float, how: str = "") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g) * scale)
        self.how = how

    def forward(self, input_ids):
        import types

        z = self.table[input_ids]
        return types.SimpleNamespace(logits=strided(z, self.how) if self.how else z)


def _batches(vocab: int, seed: int, empty: bool):
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, T in ((2, 6), (3, 5)):
        x = torch.randint(0, vocab, (rows, T), generator=g)
        y = x.clone()
        y[0, T - 2:] = -100  # right padding
        out.append({"input_ids": x, "labels": y})
    if empty:  # a batch with no target at all: it adds nothing to the sum and nothing to the count
        x = torch.randint(0, vocab, (2, 4), generator=g)
        out.insert(1, {"input_ids": x, "labels": torch.full_like(x, -100)})
    return out


def reference_token_loss(model, batches) -> float:
    """The mean next-token loss per target token, float64, target by target: ``token_loss``'s reference."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logp = torch.log_softmax(model(input_ids=b["input_ids"]).logits.double(), dim=-1)
            for i, t in (b["labels"][:, 1:] != -100).nonzero().tolist():
                total -= logp[i, t, int(b["labels"][i, t + 1])].item()
                count += 1
    return total / count


def check_token_loss__contract(m):
    call("token_loss", m.token_loss, _Bigram(7, 0, 1.0), _batches(7, 1, False), at="seed 0")  # a stub stops here
    cases = st.tuples(st.integers(0, 2**16), st.sampled_from([1.0, 1e3]), st.sampled_from(["", "slice", "transpose"]),
                      st.booleans())

    def body(case):
        seed, scale, how, empty = case
        model, batches = _Bigram(7, seed, scale, how), _batches(7, seed + 1, empty)
        at = (f"seed {seed}, logits of scale {scale:g}{', ' + how + ' view' if how else ''}"
              f"{', with an all-ignored batch' if empty else ''}")
        got = call_unmodified("token_loss", m.token_loss, model, batches, names=("model", "batches"), at=at)
        assert_type("token_loss", "the loss", got, float, at)
        assert_finite("token_loss", "the loss", got, at)
        assert_value("token_loss", "the loss", got, reference_token_loss(model, batches), tol=TOL if scale == 1 else TOL_EXTREME,
                     ref="a float64 sum over target positions / their count", at=at)

    explore(cases, body)

    class Broken(Exception):
        pass

    def broken(input_ids):
        raise Broken("the model failed")

    bad = _Bigram(7, 0, 1.0)
    bad.forward = broken
    try:
        m.token_loss(bad, _batches(7, 1, False))
    except Broken:
        return
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"token_loss: the model raised Broken, but token_loss raised {type(e).__name__} "
                             "(let the model's exception propagate)") from None
    raise AssertionError("token_loss: the model raised an exception and token_loss returned a value "
                         "(let the model's exception propagate; do not swallow it)")


# --- the replay mix ---------------------------------------------------------------------------

def _streams(seed_new: int, seed_old: int, T: int):
    from bp_mech.continual_data import TextStream

    return TextStream(torch.arange(200), 1, T, seed_new), TextStream(torch.arange(OLD, OLD + 200), 1, T, seed_old)


def _reference_batches(B, replay, period, n, seeds, T):
    """n batches drawn row by row by the docstring's rule, from fresh copies of the two streams."""
    new, old = _streams(*seeds, T)
    out = []
    for k in range(n):
        rows, flags = [], []
        for g in range(k * B, (k + 1) * B):
            is_old = (g + 1) * replay // period > g * replay // period
            rows.append((old if is_old else new).next()["input_ids"][0])
            flags.append(is_old)
        out.append((torch.stack(rows), torch.tensor(flags)))
    return out


_MIX = st.tuples(st.integers(1, 5), st.integers(1, 6), st.integers(0, 6), st.integers(1, 4), st.integers(0, 99))


def _mix(case):
    B, period, replay, n, seed = case
    return B, period, min(replay, period), n, (seed, seed + 1)


def check_ReplayStream(m):
    call("ReplayStream", m.ReplayStream, *_streams(0, 1, 4), 2, 1, 3, at="batch 2, replay 1 of every 3 rows")
    T = 4

    def body(case):
        B, period, replay, n, seeds = _mix(case)
        at = f"batch {B}, replay {replay} of every {period} rows"
        s = call("ReplayStream", m.ReplayStream, *_streams(*seeds, T), B, replay, period, at=at)
        for k, (x, flags) in enumerate(_reference_batches(B, replay, period, n, seeds, T)):
            got = call("ReplayStream.next", s.next, at=at)
            ids = got["input_ids"]
            for i in range(B):
                if i >= len(ids) or not torch.equal(ids[i].cpu(), x[i]):
                    want = "an old-domain" if flags[i] else "a new-domain"
                    raise AssertionError(f"ReplayStream: row {i} of batch number {k} is not the expected row (the run's "
                                         f"row {k * B + i} is {want} row, drawn next from its stream) at {at}")
            assert torch.equal(got["labels"].cpu(), x), f"ReplayStream: the labels differ from the inputs at {at}"
            r = got["replayed"]
            assert torch.is_tensor(r) and r.dtype == torch.bool and torch.equal(r.cpu(), flags), (
                f"ReplayStream: 'replayed' is {r!r}, expected the bool tensor {flags.tolist()} at {at}, batch {k}")
        assert_type("ReplayStream", "position", s.position, int, at)
        assert s.position == n, f"ReplayStream: position is {s.position} after {n} batches at {at}"

    explore(_MIX, body)


def fingerprint(x):
    """A comparable copy of a state: tensors cloned, generators' states, objects by their attributes.

    Args:
        x: a state (tensors, generators, dicts, lists, objects).

    Returns:
        Its fingerprint, for ``same_fingerprint``.
    """
    if torch.is_tensor(x):
        return ("t", x.detach().cpu().clone())
    if isinstance(x, torch.Generator):
        return ("t", x.get_state())
    if isinstance(x, dict):
        return {k: fingerprint(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [fingerprint(v) for v in x]
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return {"obj": fingerprint(vars(x))}
    return x


def same_fingerprint(a, b) -> bool:
    """Whether two ``fingerprint``s are equal, tensors bit for bit.

    Args:
        a, b: two fingerprints.

    Returns:
        True when they are equal.
    """
    if isinstance(a, tuple) and a and a[0] == "t":
        return isinstance(b, tuple) and b[0] == "t" and a[1].shape == b[1].shape and torch.equal(a[1], b[1])
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_fingerprint(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_fingerprint(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check_ReplayStream__resume(m):
    call("ReplayStream", m.ReplayStream, *_streams(0, 1, 4), 2, 1, 3, at="batch 2, replay 1 of every 3 rows")
    T = 4

    def body(case):
        B, period, replay, n, seeds = _mix(case)
        at = f"batch {B}, replay {replay} of every {period} rows, state after {n} batches"
        s = call("ReplayStream", m.ReplayStream, *_streams(*seeds, T), B, replay, period, at=at)
        for _ in range(n):
            s.next()
        sd = call("ReplayStream.state_dict", s.state_dict, at=at)
        assert isinstance(sd, dict), f"ReplayStream.state_dict: returned {type(sd).__name__}, expected a dict at {at}"
        assert_type("ReplayStream.state_dict", "position", sd.get("position"), int, at)
        kept = fingerprint(sd)
        want = [s.next()["input_ids"] for _ in range(3)]
        assert same_fingerprint(kept, fingerprint(sd)), (f"ReplayStream.state_dict: the returned state changed when the stream "
                                               f"drew on (return a copy) at {at}")
        fresh = m.ReplayStream(*_streams(seeds[0] + 7, seeds[1] + 9, T), B, replay, period)  # other seeds
        call("ReplayStream.load_state_dict", fresh.load_state_dict, sd, at=at)
        assert_type("ReplayStream", "position after load_state_dict", fresh.position, int, at)
        got = [fresh.next()["input_ids"] for _ in range(3)]
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (f"ReplayStream.load_state_dict: batch {k} after resuming differs from the "
                                       f"uninterrupted stream's (restore the position and both streams) at {at}")
        assert same_fingerprint(kept, fingerprint(sd)), (f"ReplayStream.load_state_dict: the loaded state changed when the "
                                               f"resumed stream drew on (copy it; keep no reference) at {at}")

    explore(_MIX, body, examples=8)


def check_ReplayStream__bad_arguments(m):
    for B, replay, period in ((2, 4, 3), (2, -1, 3), (2, 0, 0), (0, 1, 2)):
        try:
            m.ReplayStream(*_streams(0, 1, 4), B, replay, period)
        except ValueError:
            continue
        raise AssertionError(f"ReplayStream: batch {B}, replay {replay}, period {period} must raise ValueError")


def check_predict_replay_tokens(m):
    call("predict_replay_tokens", m.predict_replay_tokens, 1, 2, 4, 1, 3, at="1 update")  # a stub stops here
    cases = st.tuples(st.integers(1, 9), st.integers(1, 6), st.integers(2, 8), st.integers(1, 7), st.integers(0, 7))

    def body(case):
        updates, B, T, period, replay = case
        replay = min(replay, period)
        at = f"{updates} updates of batch {B}, seq {T}, replay {replay} of every {period} rows"
        got = call("predict_replay_tokens", m.predict_replay_tokens, updates, B, T, replay, period, at=at)
        assert_type("predict_replay_tokens", "the prediction", got, int, at)
        batches = _reference_batches(B, replay, period, updates, (0, 1), T)
        measured = sum(int((x >= OLD).sum()) for x, _ in batches)  # tokens that came from the old text
        assert got == measured, (f"predict_replay_tokens: predicted {got} old-domain tokens, measured {measured} "
                                 f"(exact: a count) at {at}")

    explore(cases, body, examples=20)


CHECKS = [check_token_loss__contract, check_ReplayStream, check_ReplayStream__resume, check_ReplayStream__bad_arguments,
          check_predict_replay_tokens]
