"""A plan's steps extrapolated in depth: the stack cut to a few shallow depths (``shallow_sessions``, where
it is one repeated block: ``signature``), one step of a strategy traced on each by a tracker that logs what
happened in order (``recording``, ``shallow_trace``), and ``planner.depth`` on those logs for the ledger at
full depth (``extrapolated``); ``by_depth`` is the plan's ``deep``, which ``planner.trace.traced`` tries first.
``period``: how many blocks a strategy's step repeats by."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from bp_mech.bench.strategy import PLAIN
from bp_mech.instruments import anatomy
from bp_mech.instruments.tracking import storage_of
from bp_mech.planner import depth
from bp_mech.planner.costs import Flops, flops_by_depth, forward_flops


def period(s) -> int:
    """How many blocks the strategy ``s``'s step repeats by: 2 for checkpoint-every2, else 1."""
    return 2 if s.checkpoint == "checkpoint-every2" else 1


def tries(layers: int, s, shard: str | None = None) -> list[tuple[int, int, int]]:
    """The depth triples ``extrapolated`` tries for the strategy ``s``, in order: from depth 1 first (the cheapest
    traces; not under FSDP2, whose one-block step never steps evenly), then from ``depth.SMALLEST``, which every
    validated family steps evenly from ([]: the stack is too shallow to gain)."""
    out = []
    for smallest in ((1,) if shard != "fsdp2" else ()) + (depth.SMALLEST,):
        at = depth.depths(layers, period(s), smallest)
        if at is not None and at not in out:
            out.append(at)
    return out


def signature(block) -> list:
    """What makes a decoder block what it is: each submodule's class and plain settings (its layer index
    aside), each parameter's shape, dtype and whether it trains (a frozen block differs from a trained one)."""
    out = []
    for name, m in block.named_modules():
        plain = sorted((k, v) for k, v in vars(m).items() if isinstance(v, (bool, int, float, str, type(None)))
                       and not k.startswith("_") and "idx" not in k and k != "layer_id")
        out.append((name, type(m).__name__, plain))
    return out + [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()]


def shallow_sessions(sess, config, make, strategies, shard: str | None = None, gpus: int = 1,
                     flops: dict | None = None) -> dict:
    """``{depth: session}``: ``config`` cut to the depths ``planner.depth`` traces for the ``strategies``'
    periods, each built by ``make(config)`` (under FSDP2 and stepped once: the first step runs its lazy
    initialisation, which later steps do not, and every traced step is a later one); {} where the stack is not
    one repeated block (per-layer settings that differ, blocks whose ``signature`` differs: layers of other
    kinds, freezing by block) or a shallow session cannot be built or stepped. ``flops``: a dict to fill with
    each depth's ``costs.forward_flops`` (None where its forward fails), counted before that warm-up step: a
    no-grad forward leaves FSDP2's state other than a step does (the checkpointed steps that followed one no
    longer extrapolated)."""
    layers = config.get_text_config().num_hidden_layers
    need = sorted({d for s in strategies for at in tries(layers, s, shard) for d in at})
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
            if flops is not None and d >= depth.SMALLEST:  # (from depth 2: every validated family's are affine)
                try:
                    flops[d] = forward_flops(out[d])
                except Exception:  # noqa: BLE001 (a forward that fails: the full model's count says why)
                    flops[d] = None
            if shard == "fsdp2":
                shallow_trace(out[d], PLAIN, None, shard, gpus)
        except Exception:  # noqa: BLE001 (a model that cannot be built or stepped shallower: traced at full depth)
            return {}
    return out


def outputs(tree) -> bool:
    """Whether an operator returned a strided tensor (the tracker then checks its phase's peak)."""
    if isinstance(tree, (tuple, list)):
        return any(outputs(x) for x in tree)
    if isinstance(tree, dict):
        return any(outputs(x) for x in tree.values())
    return storage_of(tree) is not None


@functools.lru_cache(maxsize=None)
def recording(cls):
    """``cls`` (a storage tracker) keeping a ``log`` of what happened in order: ("B" | "F", serial) a device
    storage born / freed, ("G", serial) one counted in a sharded kind, ("O", phase, outputs?, operator) an
    operator's end, ("S", phase) a phase opened, ("M", stage, host) a mark (one class per tracker class)."""
    device = torch.ops.prim.device.default  # ``tensor.device``: the tracker counts no operator there

    class Recording(cls):
        def __init__(self, device="cpu"):
            super().__init__(device)
            self.log = []

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
                self.log.append(("O", self.phase, outputs(out), func))
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

    cls, made = recording(ShardTracker if shard else StorageTracker), []

    def new(device):
        made.append(tr := cls(device))
        return tr

    if shard is None:
        with sess.tracking(new):
            led = sess.ledger(s, definition)
    else:
        led = sharding.tracked(sess, s, definition, shard, gpus, tracker=new)
    return led, depth.rows(made[-1])


def extrapolated(shallow: dict, layers: int, task, shard: str | None = None, gpus: int = 1):
    """The full-depth ledger of ``task`` (a strategy, or (strategy, definition)) from the ``shallow``
    sessions (``depth.extended`` on the first of its ``tries`` that steps evenly; a sharded plan's rank ledger,
    DDP's buckets not added); None where none does (the caller traces at full depth)."""
    s, d = task if isinstance(task, tuple) else (task, None)
    traced = {}  # depth -> (ledger, rows): a trace made for one try serves the next
    for at in tries(layers, s, shard):
        if any(x not in shallow for x in at):
            continue
        for x in at:
            if x not in traced:
                traced[x] = shallow_trace(shallow[x], s, d, shard, gpus)
        if (led := depth.extended([traced[x] for x in at], (layers - at[0]) // period(s))) is not None:
            return led
    return None


@dataclass
class ByDepth:
    """The plan's ``deep`` (``by_depth``): called with a task, its ledger extrapolated from the ``shallow``
    sessions (``extrapolated``; DDP's ``bucket`` bytes of the full model added), or None where it does not
    extrapolate; ``flops``: the plain forward's FLOPs by depth (``costs.flops_by_depth``; None: count them on
    the full model)."""

    sess: object  # the full-depth session, whose batch shape the shallow ones follow
    shallow: dict  # {depth: session}
    layers: int
    shard: str | None
    gpus: int
    bucket: int  # DDP's gradient buckets of the full model (0 unless DDP on several GPUs)
    flops: Flops | None

    def __call__(self, task):
        from bp_mech.planner.fit import reshape
        from bp_mech.planner.shard import with_buckets

        shape = tuple(self.sess.batch["input_ids"].shape)  # (what fits instead traces the session at other shapes)
        for x in self.shallow.values():
            if tuple(x.batch["input_ids"].shape) != shape:
                reshape(x, *shape)
        r = extrapolated(self.shallow, self.layers, task, self.shard, self.gpus)
        return r if r is None or self.shard != "ddp" else with_buckets(r, self.bucket)


def by_depth(sess, config, make, strategies, shard: str | None = None, gpus: int = 1) -> ByDepth | None:
    """The plan's ``ByDepth`` for ``strategies`` on ``sess`` (``shallow_sessions`` built by ``make``, their FLOPs
    counted); None where the model is not one repeated block."""
    from bp_mech.planner.shard import ddp_bucket_bytes

    counted = {}
    shallow = shallow_sessions(sess, config, make, strategies, shard, gpus, counted)
    if not shallow:
        return None
    layers = config.get_text_config().num_hidden_layers
    bucket = ddp_bucket_bytes(sess.model) if shard == "ddp" and gpus > 1 else 0
    return ByDepth(sess, shallow, layers, shard, gpus, bucket,
                   flops_by_depth(counted, layers) if None not in counted.values() else None)
