"""The training-state declarations of chapter 56 (``capture_state``, ``restore_state``), used by ``ex56``,
and the fingerprints of states it compares.

The package's trainer (``bench.trainer.phase_trainer``, under fp16 so that its GradScaler has a state to lose:
the scale grows every two updates) trains a tiny Qwen2; at update ``AT`` the solution captures its state and
the check takes its own snapshot. The reference is the check's own uninterrupted run (its losses over updates
AT + 1 .. UPDATES, bit for bit on the CPU). The drivers observe what a reader would: the pieces of the trainer
found in the captured dict; the resumed run's losses after ``restore_state`` into a fresh trainer (another init,
another data seed, the global RNG moved), with every piece of the snapshot restored, the captured dict left as
it was by training on, and the error of a state that does not fit (another model config) propagated.
"""

import copy
import functools

import torch

from bp_mech.checks.common import call
from bp_mech.checks.properties import assert_type

AT, UPDATES = 4, 8  # the update the state is captured at; the run's end


class FrameworkError(Exception):
    """What the driver turns any error of ``restore_state`` into (a state of another model must not fit)."""


def _setup():
    from bp_mech import continual_data, continual_pretrain as cpt
    from bp_mech.bench.strategy import parse
    from bp_mech.bench.trainer import phase_trainer
    from bp_mech.instruments.workload import build_model, load_text, parse_workload, tokenize

    w = parse_workload("tiny-b1s16")
    ids = tokenize(load_text("domain"))
    cfg = cpt.TrainConfig(updates=UPDATES, lr=3e-3, warmup=3, decay=3, growth_interval=2, seed=7)

    def trainer(seed, **config):  # fp16: an enabled GradScaler, whose state resumes too
        return phase_trainer(build_model(w.replace(seed=seed), **config), cfg,
                             continual_data.TextStream(ids, w.batch, w.seq, cfg.seed + seed), strategy=parse("fp16"))

    return cpt, trainer


def _threads(f):
    """``f`` run with one intra-op thread (quick on a shared machine), from torch's seed 0."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        from bp_mech.bench.timing import timing_threads

        with timing_threads("cpu"):
            torch.manual_seed(0)
            return f(*args, **kwargs)
    return run


@functools.lru_cache(maxsize=1)
@_threads
def _uninterrupted() -> tuple:
    """The check's own run: its losses over updates AT + 1 .. UPDATES (the global RNG reseeded at AT)."""
    cpt, trainer = _setup()
    t = trainer(0)
    cpt.train(t, AT)
    torch.manual_seed(1234)
    return tuple(r.loss for r in cpt.train(t, UPDATES))


def tensors(x):
    """Every tensor in a nested structure of dicts, lists and tuples."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors(v)


def snapshot(t) -> dict:
    """The check's own copy of everything the trainer's next update depends on."""
    return {"weights": {k: v.clone() for k, v in t.model.state_dict().items()},
            "optimizer": copy.deepcopy(t.optimizer.state_dict()), "scaler": t.scaler.state_dict(),
            "clock": (t.clock.updates, t.clock.skipped), "position": t.data.position,
            "generator": t.data.generator.get_state(), "rng": torch.get_rng_state()}


def _pieces(snap) -> list:
    out = [(f"the weight {k}", v) for k, v in snap["weights"].items()]
    out += [(f"AdamW's {k} of parameter {i}", v) for i, s in snap["optimizer"]["state"].items() for k, v in s.items()
            if k != "step"]
    return out + [("the data stream's generator state", snap["generator"]), ("torch's global RNG state", snap["rng"])]


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


# --- capture_state ---------------------------------------------------------------------------


def _captured(capture_state):
    """The driver: capture at ``update``; fails when the trainer changed or the dict holds a live tensor; the
    pieces of the trainer found (bit for bit) among the dict's tensors."""
    @_threads
    def run(update):
        cpt, trainer = _setup()
        t = trainer(0)
        cpt.train(t, update)
        snap = snapshot(t)
        state = call("capture_state", capture_state, t, at=f"update {update}")
        assert_type("capture_state", "the state", state, dict, f"update {update}")
        _unchanged_trainer(snap, snapshot(t))
        live = {x.untyped_storage().data_ptr(): name for name, x in t.model.state_dict().items()}
        live.update({s[k].untyped_storage().data_ptr(): f"AdamW's {k} of parameter {i}"
                     for i, s in t.optimizer.state.items() for k in s if torch.is_tensor(s[k])})
        for x in tensors(state):
            name = live.get(x.untyped_storage().data_ptr())
            if name is not None:
                raise AssertionError(f"capture_state: the state holds the live tensor {name} (a reference, not a "
                                     "copy: the next update changes it)")
        kept = list(tensors(state))
        found = []
        for what, v in _pieces(snap):
            if not any(x.shape == v.shape and x.dtype == v.dtype and torch.equal(x.cpu(), v.cpu()) for x in kept):
                raise AssertionError(f"capture_state: {what} at update {update} is nowhere in the state (it is not "
                                     "captured)")
            found.append(what)
        return found
    return run


def _unchanged_trainer(before, after):
    for what, key in (("the clock's (updates, skipped)", "clock"), ("the data position", "position"),
                      ("the GradScaler's state", "scaler")):
        assert after[key] == before[key], f"capture_state: modified the trainer: {what} {before[key]} -> {after[key]}"
    for what, key in (("the data stream's generator state", "generator"), ("torch's global RNG state", "rng")):
        assert torch.equal(after[key], before[key]), f"capture_state: modified the trainer: {what} changed"
    for k, v in before["weights"].items():
        assert torch.equal(after["weights"][k], v), f"capture_state: modified the trainer: the weight {k} changed"


@_threads
def _capture_ref(update):
    cpt, trainer = _setup()
    t = trainer(0)
    cpt.train(t, update)
    return ([what for what, _ in _pieces(snapshot(t))],)


# --- restore_state ---------------------------------------------------------------------------


def _resumed(m):
    """The driver (of the solutions module: it captures with the solution's ``capture_state``): restore the
    state of ``update`` into ``into``; fails on a piece not put back or a captured dict changed by training on;
    the resumed run's losses."""
    @_threads
    def run(update, into):
        cpt, trainer = _setup()
        ref = trainer(0)
        cpt.train(ref, update)
        torch.manual_seed(1234)  # the global RNG at the capture
        snap = snapshot(ref)
        state = call("capture_state", m.capture_state, ref, at=f"update {update}")
        if into != "a fresh trainer":  # a trainer of another model config: the state does not fit
            try:
                m.restore_state(trainer(2, num_hidden_layers=1), state)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 (any error of the framework is right: it propagated)
                raise FrameworkError(str(e)) from e
            return None
        kept = fingerprint(state)
        cpt.train(ref, UPDATES)
        assert same_fingerprint(kept, fingerprint(state)), (
            f"capture_state: the captured state changed when the trainer trained on from update {update} (it holds a "
            "live object or tensor, not a copy)")
        torch.manual_seed(999)  # a new process: another global RNG state, another init, another data seed
        fresh = trainer(1)
        out = call("restore_state", m.restore_state, fresh, state, at=f"the state of update {update}")
        assert_type("restore_state", "the return value", out, type(None), f"the state of update {update}")
        _restored(snap, snapshot(fresh), f"after restoring the state of update {update} into a fresh trainer")
        have = tuple(r.loss for r in cpt.train(fresh, UPDATES))
        for (k, a), b in zip(fresh.model.state_dict().items(), ref.model.state_dict().values()):
            assert torch.equal(a, b), (f"restore_state: the weight {k} after update {UPDATES} differs from the "
                                       "uninterrupted run's")
        assert same_fingerprint(kept, fingerprint(state)), (
            "restore_state: the state changed when the restored trainer trained on (it kept references into the "
            f"state: copy) after restoring the state of update {update}")
        return have
    return run


def _restored(snap, got, at):
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


def _restore_ref(update, into):
    from bp_mech.checks.engine import Raises

    if into != "a fresh trainer":
        return Raises(FrameworkError, "the state of a 2-layer model restored into a 1-layer one (let "
                                      "load_state_dict's error propagate; do not swallow it)")
    assert update == AT
    return (_uninterrupted(),)


_MODULE = []  # the solutions module of the check running: restore_state's driver captures with its capture_state


def _with_module(c):
    def run(m):
        _MODULE.append(m)
        try:
            return c(m)
        finally:
            _MODULE.pop()
    run.__name__ = run.__qualname__ = c.__name__
    run.tests = c.tests
    return run


def state_checks() -> list:
    """The checks of the two declarations (``engine.Contract``), in the exercise file's order; restore_state's
    driver is handed the whole solutions module (it captures with the solution's ``capture_state``).

    Returns:
        check_capture_state, check_restore_state.

    Example:
        >>> [c.__name__ for c in state_checks()]
        ['check_capture_state', 'check_restore_state']
    """
    from bp_mech.checks.engine import Contract, checks

    capture = Contract("capture_state", lambda c: {"update": c["update"]}, _capture_ref,
                       ("the pieces of the trainer found in the state",), returns=list, use=_captured, rng=True,
                       ref_name="the check's own snapshot of the trainer", examples={"": [{"update": AT}]})
    restore = Contract("restore_state", lambda c: {"update": c["update"], "into": c["into"]}, _restore_ref,
                       ("the resumed run's losses",), returns=tuple, use=lambda f: _resumed(_MODULE[-1]), rng=True,
                       tol=0.0,
                       ref_name=f"the uninterrupted run's losses over updates {AT + 1}..{UPDATES} (bit for bit)",
                       examples={"": [{"update": AT, "into": "a fresh trainer"},
                                      {"update": AT, "into": "a 1-layer model"}]})
    return [_with_module(c) for c in checks(capture, restore)]
