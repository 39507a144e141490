"""Per-GPU plans for N devices: one rank's ledger of a steady-state step under FSDP2 or DDP, traced in one process.

``rank_ledger`` builds the model under ``FakeTensorMode`` at full size, as ``bp-mech plan`` does
(``planner.lifecycle.Session``), and traces rank 0's step (``batch``: the per-rank batch):

* ``fsdp2``: a fake process group of ``gpus`` ranks (``torch.testing._internal.distributed.fake_pg``: its
  collectives move nothing) on a CPU device mesh; ``fully_shard`` on each decoder block
  (``instruments.anatomy.decoder_blocks``), then on the root; the one training step, tracked by ``ShardTracker``.
  What FSDP2 allocates is traced, not modelled: sharded parameters, gradients and AdamW moments (dim-0
  shards, padded to a multiple of ``gpus`` rows); the unsharded parameters each all-gather fills (a block's
  in its forward and again in its backward; the root's own, embedding, final norm and head, from its
  forward to the end of the backward: FSDP2 does not reshard the root after forward); the collectives' buffers.
* ``ddp``: a full replica (the one-device step) plus DDP's gradient buckets, *counted*, not traced: DDP
  cannot be built on fake parameters (its constructor reads their data). With ``gradient_as_bucket_view=False``
  (DDP's default) the buckets hold a copy of every gradient, made when DDP is built and kept, so whatever
  their split (25 MiB, the first 1 MiB, rebuilt in the gradients' order) they add the bytes of every
  parameter that takes a gradient, at every stage (the real reducer's ``bucket_sizes`` sum to it: the test).

The classes stay ``ledger_table.CLASSES``: gathered parameters count as "parameters", the collectives' buffers (and
DDP's buckets) as "other"; ``RankLedger.gathered`` / ``.collective`` say how many bytes of those they are.
Validation: tests/planner/test_shard.py (2 and 4 gloo processes running ``fully_shard``, 2 running DDP).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass


from bp_mech.instruments import anatomy
from bp_mech.planner import build, lifecycle
from bp_mech.planner.definitions import STEADY, StepDefinition
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import PLAIN, Strategy
from bp_mech.planner.shard_tracking import ShardTracker
from bp_mech.ledger_table import CLASSES, STAGES, Ledger

SHARDINGS = ("fsdp2", "ddp")  # how the model is spread over the GPUs (``rank_ledger``'s ``shard``)
PEAKS = ("forward_peak", *STAGES)  # the snapshots a RankLedger splits: the forward's peak, then the ledger's stages


@dataclass(frozen=True)
class RankLedger:
    """One rank's ledger of a sharded step, with what of it FSDP gathered and what the collectives hold.

    Example:
        >>> stages = {s: dict.fromkeys(CLASSES, 10) for s in STAGES}
        >>> r = RankLedger(Ledger("fake-tensor", "plain", stages, forward_peak=70), "fsdp2", 2,
        ...                dict.fromkeys(PEAKS, 4), dict.fromkeys(PEAKS, 1), dict.fromkeys(PEAKS, stages["load"]),
        ...                dict(gathered=5, collective=2))
        >>> r.peak, r.peaks()["gathered"], r.peaks()["parameters"]
        (70, 4, 10)
    """

    ledger: Ledger  # rank 0's ledger (bp_mech.ledger): bytes per stage and class, its peak
    shard: str  # fsdp2 | ddp
    gpus: int  # ranks (world size)
    gathered: dict[str, int]  # PEAKS -> bytes of unsharded parameters gathered by FSDP (within "parameters")
    collective: dict[str, int]  # PEAKS -> bytes of all-gather / reduce-scatter buffers, DDP's buckets (within "other")
    classes: dict[str, dict[str, int]]  # PEAKS -> class -> bytes (the ledger's stages, and the forward's peak split)
    most: dict[str, int]  # gathered | collective -> most bytes alive at once in the step (any moment, not a snapshot)

    @property
    def peak(self) -> int:  # the rank's peak in bytes: ``ledger.peak``
        return self.ledger.peak

    def peaks(self) -> dict[str, int]:
        """Each class's largest bytes over the snapshots (``PEAKS``), and the gathered and collective lines'."""
        out = {c: max(self.classes[x][c] for x in PEAKS) for c in CLASSES}
        return dict(out, gathered=max(self.gathered.values()), collective=max(self.collective.values()))


def fsdp2(mesh):
    """``prepare`` for ``Session``: ``fully_shard`` every decoder block on ``mesh``, then the root (FSDP2's defaults:
    the blocks resharded after forward, the root not)."""
    from torch.distributed.fsdp import fully_shard

    def prepare(model):
        for block in anatomy.decoder_blocks(model):  # (found again after: by the block classes' MRO)
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return prepare


def ddp(model):
    """``prepare`` for ``Session`` on real tensors: ``DistributedDataParallel(model)`` (its defaults: 25 MiB
    buckets, ``gradient_as_bucket_view=False``), with the model's config on the wrapper
    (``instruments.anatomy`` reads the rest through DDP's ``module``)."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model)
    wrapped.config = model.config  # (the rest instruments.anatomy reads through DDP's .module)
    return wrapped


def tracked(session: lifecycle.Session, s: Strategy = PLAIN, definition: StepDefinition | None = None,
            shard: str = "fsdp2", gpus: int = 1, tracker=ShardTracker) -> RankLedger:
    """One step of ``session`` (sharded by its ``prepare``) tracked by a ``ShardTracker`` (``tracker``: that class
    or a subclass): its ``RankLedger``.
    The test's gloo ranks call it on real sessions; ``rank_ledger`` on a fake one. Every step starts from the
    steady state, the root resharded as the last backward left it (a no-grad forward, such as the FLOP count's,
    leaves it gathered: an offload entered then would take its gathered weights for parameters and keep them)."""
    from torch.distributed.fsdp import FSDPModule

    made, fsdp = [], isinstance(session.model, FSDPModule)

    def new(device):
        if fsdp:  # as a backward would: the fake step's kept outputs come from a no-grad forward, which leaves
            session.model.reshard()  # the root gathered
        made.append(tr := tracker(device))
        return tr

    if fsdp:
        session.model.reshard()
    with session.tracking(new):
        led = session.ledger(s, definition)
    tr = made[-1]
    snaps = {x: tr.marks[x][1] for x in ("load", "forward", "backward", "zero_grad")}  # (as Session.step)
    snaps.update(forward_peak=tr.peaks["forward"][1], backward_peak=tr.peaks["backward"][1],
                 optimizer_peak=tr.peaks["optimizer"][1] if "optimizer" in tr.peaks else tr.marks["backward"][1])
    return RankLedger(led, shard, gpus, {x: tr.kinds(snaps[x])["gathered"] for x in PEAKS},
                      {x: tr.kinds(snaps[x])["collective"] for x in PEAKS},
                      {x: tr.classify(snaps[x], CLASSES) for x in PEAKS}, dict(tr.most))


@contextlib.contextmanager
def fake_group(gpus: int):
    """A fake process group of ``gpus`` ranks (this process rank 0) and its CPU device mesh, destroyed on exit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # (one per process: the fake one would replace a real one)
        raise RuntimeError("a process group is already initialized: rank_ledger makes its own fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=gpus)
    try:
        yield init_device_mesh("cpu", (gpus,))
    finally:
        dist.destroy_process_group()


def ddp_bucket_bytes(model) -> int:
    """DDP's gradient buckets (``gradient_as_bucket_view=False``): a copy of every gradient, in bytes."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def with_buckets(r: RankLedger, bucket: int) -> RankLedger:
    """``r`` (a one-device ledger) plus DDP's buckets in "other" at every stage and in the forward's peak."""
    led = r.ledger
    led = dataclasses.replace(led, stages={x: dict(c, other=c["other"] + bucket) for x, c in led.stages.items()},
                              forward_peak=led.forward_peak + bucket,
                              rounded={x: v + -(-bucket // 512) * 512 for x, v in led.rounded.items()})
    classes = {x: dict(c, other=c["other"] + bucket) for x, c in r.classes.items()}
    return RankLedger(led, "ddp", r.gpus, r.gathered, dict.fromkeys(PEAKS, bucket), classes,
                      dict(r.most, collective=bucket))


@contextlib.contextmanager
def planning(shard: str, gpus: int):
    """What ``planner.plan.plan`` needs to plan rank 0 of ``gpus`` devices sharded by ``shard``, for the
    duration of the plan: ``(prepare, trace)``, ``prepare`` for its ``Session`` (None for ddp) and
    ``trace(session, strategy, definition=None) -> RankLedger`` (``tracked``, with DDP's buckets added)."""
    check(shard, gpus)
    if shard == "ddp":
        def trace(session, s, definition=None):
            r = tracked(session, s, definition, "ddp", gpus)
            return with_buckets(r, ddp_bucket_bytes(session.model) if gpus > 1 else 0)
        yield None, trace
        return
    with fake_group(gpus) as mesh:
        yield fsdp2(mesh), lambda session, s, definition=None: tracked(session, s, definition, "fsdp2", gpus)


def check(shard: str, gpus: int) -> None:
    """ValueError for an unknown ``shard``, ``gpus < 1``, or ``gpus < 2`` for fsdp2."""
    if shard not in SHARDINGS:
        raise ValueError(f"unknown sharding {shard!r}; known: {', '.join(SHARDINGS)}")
    if gpus < (2 if shard == "fsdp2" else 1):  # (FSDP2 on one rank copies instead of gathering: not classified)
        raise ValueError(f"{shard} needs gpus >= {2 if shard == 'fsdp2' else 1}, got {gpus}")


def rank_ledger(config, batch: int, seq: int, gpus: int, shard: str, strategy: Strategy = PLAIN,
                options: StepOptions = StepOptions(), definition: StepDefinition = STEADY,
                finetune=None) -> RankLedger:
    """Rank 0's ledger of one step (``definition``: the steady state by default) on ``gpus`` devices
    sharded by ``shard``, traced in this process under fake tensors at full size.

    Args:
        config: a Transformers causal-LM config (``AutoModelForCausalLM.from_config`` builds it).
        batch: sequences per rank (the per-GPU batch; the global batch is ``gpus * batch``).
        seq: tokens per sequence.
        gpus: ranks, >= 1 (>= 2 for fsdp2).
        shard: "fsdp2" (``fully_shard`` on each decoder block and the root) or "ddp" (replicas and
            gradient buckets); see ``SHARDINGS``.
        strategy: the memory strategy of the step (``bench.strategy``); default plain.
        options: how the step runs (``StepOptions``: AdamW implementation, offload threshold); pass
            ``options.for_device("cuda")`` to estimate a GPU.
        definition: which step (``planner.definitions.StepDefinition``).
        finetune: frozen parameters or LoRA (``planner.finetune.FineTune``); None: full training.

    Returns:
        A ``RankLedger``: ``.ledger`` (source "fake-tensor": bytes per stage and class, ``.peak``), the
        ``gathered`` and ``collective`` bytes per stage (within "parameters" and "other"), ``peaks()``.

    Raises:
        ValueError: an unknown ``shard``, ``gpus < 1``, or ``gpus < 2`` for fsdp2 (one device: the plain plan).

    Example:
        >>> from transformers import AutoConfig
        >>> cfg = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=384, max_position_embeddings=256)
        >>> one, two = rank_ledger(cfg, 2, 32, 1, "ddp"), rank_ledger(cfg, 2, 32, 2, "fsdp2")
        >>> two.ledger.total("load") < one.ledger.total("load"), two.peaks()["gathered"] > 0
        (True, True)
    """
    with planning(shard, gpus) as (prepare, trace):
        session = lifecycle.Session(build.ConfigWorkload(config, batch, seq, finetune=finetune), fake=True,
                                    options=options, definition=definition, prepare=prepare)
        return trace(session, strategy)
