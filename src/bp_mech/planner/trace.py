"""How ``bp-mech plan`` traces its candidates: one strategy's step at a time (``traced``: its ledger, or a
``bench.oom.Failed`` with the one-line reason it could not be traced: the strategy's failure, not the plan's
end), in forked processes that inherit the fake session (``ledgers``, on ``planner.pool``), each extrapolated
in depth from shallow copies of the stack where it is one repeated block (``by_depth``: ``planner.depth`` on
the ``recording`` tracker's log), and an exception as one line (``one_line``)."""

from __future__ import annotations

import torch

from bp_mech.bench.oom import Failed
from bp_mech.bench.strategy import PLAIN
from bp_mech.instruments import anatomy
from bp_mech.instruments.tracking import storage_of
from bp_mech.planner import depth
from bp_mech.planner.pool import forked_map


def one_line(e: BaseException, width: int = 160) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:width] if text else ''}".rstrip(": ")


def traced(sess, trace, task, deep=None):
    """One strategy's trace: its ledger, or why it has none.

    Args:
        sess: the fake session (``planner.lifecycle.Session``).
        trace: ``trace(sess, s, d)``, e.g. ``planner.shard.planning``'s rank ledger; None: ``sess.ledger``.
        task: a strategy, or (strategy, ``StepDefinition``).
        deep: ``by_depth``'s, tried first: the ledger extrapolated from shallow traces; None: full depth only.

    Returns:
        The ledger (or rank ledger), or a ``bench.oom.Failed`` whose ``failure`` is the one-line reason it could
        not be traced (an operation the fake trace cannot run: the strategy is left out of the plan).

    Example:
        >>> traced(None, lambda sess, s, d: 1 / 0, "plain")
        Failed(failure='ZeroDivisionError: division by zero', name='plain')
    """
    s, d = task if isinstance(task, tuple) else (task, None)
    try:
        if deep is not None and (led := deep(task)) is not None:
            return led
    except Exception:  # noqa: BLE001 (a shallow step that fails: the full one says why, or succeeds)
        pass
    try:
        return trace(sess, s, d) if trace is not None else sess.ledger(s, d)
    except Exception as e:  # noqa: BLE001 (any failure of that one trace; the plan goes on without it)
        return Failed(one_line(e), getattr(s, "name", str(s)))


def ledgers(sess, strategies, workers: int = 1, trace=None, deep=None):
    """The session's ledger of each strategy, in order (``traced``: a ``bench.oom.Failed`` where one fails).

    Args:
        sess: the fake session (``planner.lifecycle.Session``).
        strategies: strategies, or (strategy, ``StepDefinition``) pairs.
        workers: processes (``planner.pool.forked_map``: forked, they inherit the session and a sharded
            plan's fake process group, so nothing is rebuilt or pickled but the ledgers); 1: this process.
        trace, deep: ``traced``'s.

    Returns:
        A generator of the ledgers, in the order of ``strategies``; the longest traces (more forward
        passes and hooks: more operations) are handed out first.

    Example:
        >>> list(ledgers(None, ["plain"], trace=lambda sess, s, d: s.upper()))
        ['PLAIN']
    """
    def work(task):
        s = task[0] if isinstance(task, tuple) else task
        return s.micro_batches * (2 + (s.checkpoint != "plain") + s.offload)

    return forked_map(lambda task: traced(sess, trace, task, deep), strategies, workers, cost=work)


def period(s) -> int:
    """How many blocks the strategy ``s``'s step repeats by: 2 for checkpoint-every2, else 1."""
    return 2 if s.checkpoint == "checkpoint-every2" else 1


def signature(block) -> list:
    """What makes a decoder block what it is: each submodule's class and plain settings (its layer index
    aside), each parameter's shape, dtype and whether it trains (a frozen block differs from a trained one)."""
    out = []
    for name, m in block.named_modules():
        plain = sorted((k, v) for k, v in vars(m).items() if isinstance(v, (bool, int, float, str, type(None)))
                       and not k.startswith("_") and "idx" not in k and k != "layer_id")
        out.append((name, type(m).__name__, plain))
    return out + [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()]


def shallow_sessions(sess, config, make, strategies, shard: str | None = None, gpus: int = 1) -> dict:
    """``{depth: session}``: ``config`` cut to the depths ``planner.depth`` traces for the ``strategies``'
    periods, each built by ``make(config)`` (under FSDP2 and stepped once: the first step runs its lazy
    initialisation, which later steps do not, and every traced step is a later one); {} where the stack is not
    one repeated block (per-layer settings that differ, blocks whose ``signature`` differs: layers of other
    kinds, freezing by block) or a shallow session cannot be built or stepped."""
    layers = config.get_text_config().num_hidden_layers
    need = sorted({d for s in strategies for d in (depth.depths(layers, period(s)) or ())})
    blocks = anatomy.decoder_blocks(sess.model)
    one = signature(blocks[0]) if need and len(blocks) == layers else None
    if one is None or any(signature(b) != one for b in blocks[1:]):
        return {}
    out = {}
    for d in need:
        cut = depth.shallow(config, d)
        if cut is None:
            return {}
        try:
            out[d] = make(cut)
            if any(signature(b) != one for b in anatomy.decoder_blocks(out[d].model)):
                return {}
            if shard == "fsdp2":
                shallow_trace(out[d], PLAIN, None, shard, gpus)
        except Exception:  # noqa: BLE001 (a model that cannot be built or stepped shallower: traced at full depth)
            return {}
    return out


def _outputs(tree) -> bool:
    """Whether an operator returned a strided tensor (the tracker then checks its phase's peak)."""
    if isinstance(tree, (tuple, list)):
        return any(_outputs(x) for x in tree)
    if isinstance(tree, dict):
        return any(_outputs(x) for x in tree.values())
    return storage_of(tree) is not None


def recording(cls):
    """``cls`` (a storage tracker) keeping a ``log`` of what happened in order: ("B" | "F", serial) a device
    storage born / freed, ("G", serial) one counted in a sharded kind, ("O", phase, outputs?, operator) an
    operator's end, ("S", phase) a phase opened, ("M", stage, host) a mark. Each one made is in ``made``."""
    device = torch.ops.prim.device.default  # ``tensor.device``: the tracker counts no operator there

    class Recording(cls):
        made: list = []

        def __init__(self, device="cpu"):
            super().__init__(device)
            self.log = []
            Recording.made.append(self)

        def _free(self, serial, ref) -> None:
            alive = serial in self.live
            super()._free(serial, ref)
            if alive:
                self.log.append(("F", serial))

        def _count(self, storage, label, host):
            serial = super()._count(storage, label, host)
            if not host:
                self.log.append(("B", serial))
            return serial

        def _grow(self, serial, kind) -> None:
            super()._grow(serial, kind)
            self.log.append(("G", serial))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is not device:
                self.log.append(("O", self.phase, _outputs(out), func))
            return out

        def start(self, phase: str) -> None:
            super().start(phase)
            self.log.append(("S", phase))

        def mark(self, stage: str, host: int = 0) -> None:
            super().mark(stage, host)
            self.log.append(("M", stage, host))
    return Recording


def shallow_trace(sess, s, definition, shard: str | None, gpus: int):
    """One step of ``s`` on a shallow session, recorded (``recording``): (its ledger, ``depth.rows``)."""
    from bp_mech.instruments.tracking import StorageTracker
    from bp_mech.planner import shard as sharding
    from bp_mech.planner.shard_tracking import ShardTracker

    made = recording(ShardTracker if shard else StorageTracker)
    if shard is None:
        sess.tracker = made
        try:
            led = sess.ledger(s, definition)
        finally:
            sess.tracker = StorageTracker
    else:
        led = sharding.tracked(sess, s, definition, shard, gpus, tracker=made)
    return led, depth.rows(made.made[-1])


def extrapolated(shallow: dict, layers: int, task, shard: str | None = None, gpus: int = 1):
    """The full-depth ledger of ``task`` (a strategy, or (strategy, definition)) from the ``shallow``
    sessions (``depth.extended``; a sharded plan's rank ledger, DDP's buckets not added); None where it does
    not extrapolate (the caller traces at full depth)."""
    s, d = task if isinstance(task, tuple) else (task, None)
    at = depth.depths(layers, period(s))
    if at is None or any(x not in shallow for x in at):
        return None
    traced = [shallow_trace(shallow[x], s, d, shard, gpus) for x in at]
    return depth.extended(traced, (layers - at[0]) // period(s))


def by_depth(sess, config, make, strategies, shard: str | None = None, gpus: int = 1):
    """``deep`` for ``traced``: ``task -> ledger | None``, each task's ledger extrapolated from the shallow
    sessions (``shallow_sessions``, ``extrapolated``; DDP's buckets added for the full model); None where the
    model is not one repeated block."""
    from bp_mech.planner.fit import reshape
    from bp_mech.planner.shard import ddp_bucket_bytes, with_buckets

    shallow = shallow_sessions(sess, config, make, strategies, shard, gpus)
    if not shallow:
        return None
    layers = config.get_text_config().num_hidden_layers
    bucket = ddp_bucket_bytes(sess.model) if shard == "ddp" and gpus > 1 else 0

    def deep(task):
        shape = tuple(sess.batch["input_ids"].shape)  # (what fits instead traces the session at other shapes)
        for x in shallow.values():
            if tuple(x.batch["input_ids"].shape) != shape:
                reshape(x, *shape)
        r = extrapolated(shallow, layers, task, shard, gpus)
        return r if r is None or shard != "ddp" else with_buckets(r, bucket)
    deep.shallow = shallow  # (``plan.plain_flops`` counts the forward's FLOPs on them)
    return deep
