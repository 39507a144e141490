"""Checks of exercises/ex56_continual_pretrain.py (never against the answer file).

* ``token_loss``: against a float64 sum over positions, written out here, on a bigram model whose token
  losses range widely and on batches with different numbers of targets (right padding and a hole in the
  middle): a mean of per-batch means, a count that includes the ignored positions, or a missing shift
  gives another number.
* ``capture_state`` / ``restore_state``: the package's trainer (``bench.trainer.phase_trainer``, under fp16
  so that its GradScaler has a state to lose: the scale grows every two updates) trains a tiny Qwen2
  uninterrupted; at update ``AT`` the solution captures its state, and the check takes its own snapshot. A fresh trainer
  (another init, another data seed, the global RNG moved) restores the state; its clock, data position,
  generator, GradScaler, global RNG, AdamW state and weights must equal the snapshot, and training on must
  give the uninterrupted run's losses and weights bit for bit (CPU, same kernels). The contract around it:
  capturing changes nothing in the trainer; training on (the captured trainer, then the restored one)
  changes nothing in the captured dict; ``restore_state`` returns None and lets the error of a state that
  does not fit (another model config) propagate.

The explored contract of ``token_loss`` and the replay-mix exercises are in ``ex56_contract``.
"""

import copy
import types

import torch

from bp_mech.bench.strategy import parse
from bp_mech.bench.timing import timing_threads
from bp_mech.bench.trainer import phase_trainer
from bp_mech.checks.common import assert_value, call
from bp_mech.checks.ex56_contract import CHECKS as CONTRACT, fingerprint, reference_token_loss, same_fingerprint
from bp_mech.checks.properties import assert_type

TOL = 1e-6  # float32 logits, cross-entropy summed in float32 per batch: relative to a float64 reference
AT, UPDATES = 4, 8  # the update the state is captured at; the run's end


class Bigram(torch.nn.Module):
    """logits[b, t] = table[x[b, t]]: token losses from ~0 to ~20 nats."""

    def __init__(self, vocab: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g) * 4)

    def forward(self, input_ids):
        return types.SimpleNamespace(logits=self.table[input_ids])


def _batches(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, T, pads in ((2, 12, (0, 3)), (3, 12, (9, 0, 5)), (1, 7, (4,))):  # different target counts
        x = torch.randint(0, vocab, (rows, T), generator=g)
        y = x.clone()
        for r, p in enumerate(pads):
            if p:
                y[r, T - p:] = -100
        y[0, 2] = -100  # a hole: position 1 has no target
        out.append({"input_ids": x, "labels": y})
    return out


def check_token_loss(m):
    for seed in (0, 1):
        model, batches = Bigram(11, seed), _batches(11, seed + 10)
        model.train()
        got = call("token_loss", m.token_loss, model, batches, at=f"seed {seed}")
        assert_value("token_loss", "the loss", got, reference_token_loss(model, batches), tol=TOL,
                     ref="a float64 sum over target positions / their count",
                     at=f"3 batches with 16, 19 and 2 targets (seed {seed})")
        assert model.training, "token_loss: leave the model in the mode it was in (it was training)"


# --- the training state -------------------------------------------------------------------

def _setup():
    from bp_mech import continual_data, continual_pretrain as cpt
    from bp_mech.instruments.workload import build_model, load_text, parse_workload, tokenize

    w = parse_workload("tiny-b1s16")
    ids = tokenize(load_text("domain"))
    cfg = cpt.TrainConfig(updates=UPDATES, lr=3e-3, warmup=3, decay=3, growth_interval=2, seed=7)

    def trainer(seed, **config):  # fp16: an enabled GradScaler, whose state resumes too
        return phase_trainer(build_model(w.replace(seed=seed), **config), cfg,
                             continual_data.TextStream(ids, w.batch, w.seq, cfg.seed + seed), strategy=parse("fp16"))

    return cpt, trainer


def _tensors(x):
    """Every tensor in a nested structure of dicts, lists and tuples."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _snapshot(t) -> dict:
    return {"weights": {k: v.clone() for k, v in t.model.state_dict().items()},
                "optimizer": copy.deepcopy(t.optimizer.state_dict()), "scaler": t.scaler.state_dict(),
                "clock": (t.clock.updates, t.clock.skipped), "position": t.data.position,
                "generator": t.data.generator.get_state(), "rng": torch.get_rng_state()}


def check_capture_state__a_copy_of_everything(m):
    with timing_threads("cpu"):  # one intra-op thread: quick on a shared machine
        _check_capture(m)


def _check_capture(m):
    cpt, trainer = _setup()
    t = trainer(0)
    cpt.train(t, AT)
    snap = _snapshot(t)
    state = call("capture_state", m.capture_state, t, at=f"update {AT}")
    assert isinstance(state, dict), f"capture_state: returned {type(state).__name__}, expected a dict"
    _unchanged_trainer(snap, _snapshot(t))
    live = {x.untyped_storage().data_ptr(): name for name, x in t.model.state_dict().items()}
    live.update({s[k].untyped_storage().data_ptr(): f"AdamW's {k} of parameter {i}"
                 for i, s in t.optimizer.state.items() for k in s if torch.is_tensor(s[k])})
    for x in _tensors(state):
        if x.untyped_storage().data_ptr() in live:
            raise AssertionError(f"capture_state: the state holds the live tensor {live[x.untyped_storage().data_ptr()]}"
                                 " (a reference, not a copy: the next update changes it)")
    kept = list(_tensors(state))
    wanted = [(f"the weight {k}", v) for k, v in snap["weights"].items()]
    wanted += [(f"AdamW's {k} of parameter {i}", v) for i, s in snap["optimizer"]["state"].items() for k, v in s.items()
               if k != "step"]
    wanted += [("the data stream's generator state", snap["generator"]), ("torch's global RNG state", snap["rng"])]
    for what, v in wanted:
        if not any(x.shape == v.shape and x.dtype == v.dtype and torch.equal(x.cpu(), v.cpu()) for x in kept):
            raise AssertionError(f"capture_state: {what} at update {AT} is nowhere in the state (it is not captured)")


def _unchanged_trainer(before, after):
    for what, key in (("the clock's (updates, skipped)", "clock"), ("the data position", "position"),
                      ("the GradScaler's state", "scaler")):
        assert after[key] == before[key], f"capture_state: modified the trainer: {what} {before[key]} -> {after[key]}"
    for what, key in (("the data stream's generator state", "generator"), ("torch's global RNG state", "rng")):
        assert torch.equal(after[key], before[key]), f"capture_state: modified the trainer: {what} changed"
    for k, v in before["weights"].items():
        assert torch.equal(after["weights"][k], v), f"capture_state: modified the trainer: the weight {k} changed"


def check_restore_state__resume_bit_for_bit(m):
    with timing_threads("cpu"):
        _check_restore(m)


def _check_restore(m):
    cpt, trainer = _setup()
    ref = trainer(0)
    cpt.train(ref, AT)
    torch.manual_seed(1234)  # the global RNG at the capture
    snap = _snapshot(ref)
    state = call("capture_state", m.capture_state, ref, at=f"update {AT}")
    kept = fingerprint(state)
    want = [r.loss for r in cpt.train(ref, UPDATES)]
    assert same_fingerprint(kept, fingerprint(state)), (f"capture_state: the captured state changed when the trainer trained "
                                              f"on from update {AT} (it holds a live object or tensor, not a copy)")
    torch.manual_seed(999)  # a new process: another global RNG state, another init, another data seed
    fresh = trainer(1)
    out = call("restore_state", m.restore_state, fresh, state, at=f"the state of update {AT}")
    assert_type("restore_state", "the return value", out, type(None), f"the state of update {AT}")
    got = _snapshot(fresh)
    at = f"after restoring the state of update {AT} into a fresh trainer"
    for what, key, hint in (("the clock's (updates, skipped)", "clock", "the update clock"),
                            ("the data position", "position", "the data stream's position"),
                            ("the GradScaler's state", "scaler", "the GradScaler")):
        assert got[key] == snap[key], f"restore_state: {what} is {got[key]}, expected {snap[key]} {at} (restore {hint})"
    for what, key in (("the data stream's generator state", "generator"), ("torch's global RNG state", "rng")):
        assert torch.equal(got[key], snap[key]), f"restore_state: {what} differs from the capture's {at} (restore it)"
    for k, v in snap["weights"].items():
        assert torch.equal(got["weights"][k], v), f"restore_state: the weight {k} differs from the capture's {at}"
    for i, s in snap["optimizer"]["state"].items():
        for k, v in s.items():
            have = got["optimizer"]["state"].get(i, {}).get(k)
            assert have is not None and torch.equal(have, v), \
                f"restore_state: AdamW's {k} of parameter {i} differs from the capture's {at} (restore the optimizer)"
    have = [r.loss for r in cpt.train(fresh, UPDATES)]
    diff = max((abs(a - b) for a, b in zip(have, want)), default=0.0) if len(have) == len(want) else float("inf")
    assert diff == 0.0, (f"restore_state: the resumed run's losses differ from the uninterrupted run's by up to "
                         f"{diff:.3g} over updates {AT + 1}..{UPDATES} (bit for bit expected on the CPU)")
    for (k, a), b in zip(fresh.model.state_dict().items(), ref.model.state_dict().values()):
        assert torch.equal(a, b), f"restore_state: the weight {k} after update {UPDATES} differs from the uninterrupted run's"
    assert same_fingerprint(kept, fingerprint(state)), (f"restore_state: the state changed when the restored trainer trained on "
                                              f"(it kept references into the state: copy) {at}")
    other = trainer(2, num_hidden_layers=1)  # a trainer of another model config: the state does not fit
    try:
        m.restore_state(other, state)
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 (any error of the framework is right: it propagated)
        return
    raise AssertionError(f"restore_state: the state of update {AT} (2 layers) was restored into a 1-layer model "
                         "without an error (let load_state_dict's error propagate; do not swallow it)")


CHECKS = [check_token_loss, check_capture_state__a_copy_of_everything, check_restore_state__resume_bit_for_bit,
          *CONTRACT]
