"""Per-GPU plans (``bp_mech.planner.shard``) against real ranks: 2 and 4 gloo processes running ``fully_shard``
(2 running DDP) on a real step of the same tiny model, each tracking its own step as ``Session(fake=False)``
does (real tensors, source "tracked-cpu", ``shard_tracking.ShardTracker``), against the one-process fake-tensor trace.

Why 2 % holds: the fake trace runs the same program (FSDP2's own all-gathers, copy-outs, reduce-scatters
and resizes, on a fake process group whose collectives move nothing): shapes, and so bytes, are those of
the real step. What differs is only what a fake step cannot do: a real steady step runs its warm-up
update first (FSDP's gathered-parameter storages then exist, resized to 0, and are grown again by
``resize_``; in the fake step the first forward makes them), which leaves the bytes equal. The checks are
per class (parameters, gradients, optimizer states, saved activations, logits, other), per line (gathered
parameters, collective buffers) and for the total peak; the lines must be > 0, and the sharded ledger must
lie below the one-device one (a plan that did not shard could not pass), with the gathered line equal to
the root's and one block's parameters counted from the model (a plan that never freed a gathered block could
not pass). DDP's buckets are made when DDP is built, before any tracked step: the real side's are the
reducer's own ``bucket_sizes``; the plan's, a copy of every gradient. Cases: Qwen2 (a Llama layout) and
GPT-NeoX (fused QKV, parallel residual), the outputs dropped before backward and kept through it.
"""

import multiprocessing as mp

import pytest
import torch

from bp_mech.planner import build, lifecycle, shard
from bp_mech.planner.definitions import STEADY, StepDefinition
from bp_mech.planner.finetune import FineTune
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import PLAIN, parse

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, vocab_size=384,
            max_position_embeddings=256)
FAMILY_FIELDS = {"qwen2": dict(num_key_value_heads=2), "gpt_neox": {}}  # a Llama layout and a fused-QKV one
BATCH, SEQ = 2, 32  # per rank
TOL = 0.02  # the bound (see the module docstring)
CPU = StepOptions().for_device("cpu")  # both sides with the CPU's settings: foreach AdamW
KEEP = StepDefinition(keep_outputs=True)  # the loop that holds ``out`` through backward
LINES = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss", "other",
         "gathered", "collective", "most_gathered", "most_collective")  # most_*: at any moment, not at a snapshot
MIXED = "checkpoint-all+fp16+micro2+chunked-loss"  # four mechanisms at once under FSDP2
LORA = FineTune(lora_rank=4)  # a PEFT model under FSDP2: fully_shard renames its class (FSDPPeftModelForCausalLM)
# (family, sharding, outputs kept, strategy, fine-tuning) run by every rank of a world
CASES = {2: (("qwen2", "fsdp2", False, "plain", None), ("qwen2", "fsdp2", True, "plain", None),
             ("qwen2", "fsdp2", False, MIXED, None), ("qwen2", "fsdp2", False, "plain", LORA),
             ("qwen2", "fsdp2", False, "checkpoint-all+chunked-loss", LORA),
             ("gpt_neox", "fsdp2", False, "plain", None), ("qwen2", "ddp", False, "plain", None)),
         4: (("qwen2", "fsdp2", False, "plain", None),)}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread


def tiny_config(family: str = "qwen2"):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **TINY, **FAMILY_FIELDS[family])


def unsharded_bytes(family: str) -> tuple[int, list[int]]:
    """(the root's own parameters, each block's), in bytes, counted: what FSDP2 gathers at most at once is the
    root's (embedding, final norm, head: gathered from the root's forward to the end of the backward) and
    one block's; the largest all-gather buffer holds one block (dim 0 divides by 2 and 4 here: no padding)."""
    from transformers import AutoModelForCausalLM

    from bp_mech.instruments.anatomy import decoder_blocks

    model = AutoModelForCausalLM.from_config(tiny_config(family))
    blocks = decoder_blocks(model)
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return size(p for p in model.parameters() if id(p) not in in_blocks), [size(b.parameters()) for b in blocks]


def lines(r: shard.RankLedger) -> dict[str, int]:
    """Each line's peak: the classes' and kinds' at the snapshots, the kinds' at any moment (``most_``)."""
    return dict(r.peaks(), **{f"most_{k}": v for k, v in r.most.items()})


def _rank(rank: int, world: int, init: str, out) -> None:
    """One gloo rank: for each case of ``CASES[world]``, a real session sharded that way and its tracked steady
    step; puts (rank, case, peaks, peak, finite, source, gathered)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        for case in CASES[world]:
            family, how, keep, name, ft = case
            prepare = shard.fsdp2(init_device_mesh("cpu", (world,))) if how == "fsdp2" else shard.ddp
            session = lifecycle.Session(build.ConfigWorkload(tiny_config(family), BATCH, SEQ, finetune=ft), "cpu",
                                        options=CPU,
                                        definition=KEEP if keep else STEADY, prepare=prepare)
            if how == "ddp":  # DDP rebuilds its buckets in the second forward: the steady state is the third step
                session.ledger(PLAIN)
            r = shard.tracked(session, parse(name), None, how, world)
            peaks, peak = lines(r), r.peak
            if how == "ddp":  # DDP's buckets, made before the step: the reducer's own account of their bytes
                sizes = session.model._get_ddp_logging_data()["bucket_sizes"]  # "1048576, 2048" (a string)
                buckets = sum(int(x) for x in str(sizes).replace(",", " ").split())
                peaks = dict(peaks, other=peaks["other"] + buckets, collective=buckets, most_collective=buckets)
                peak += buckets
            out.put((rank, case, peaks, peak, r.ledger.finite, r.ledger.source, r.gathered, r.classes, r.collective))
    finally:
        dist.destroy_process_group()


def real_ranks(world: int, tmp) -> dict[tuple, dict[int, tuple]]:
    """``world`` spawned gloo ranks running ``_rank``: case -> rank -> (peaks, peak, finite, source, gathered)."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp / "store"), out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = {case: {} for case in CASES[world]}
    while not out.empty():
        rank, case, *rest = out.get()
        got[tuple(case)][rank] = rest
    assert all(sorted(ranks) == list(range(world)) for ranks in got.values()), got
    return got


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """world -> case -> rank -> what the rank measured (each world spawned once, when first asked for)."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = real_ranks(world, tmp_path_factory.mktemp(f"gloo{world}"))
        return cache[world]

    return get


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases],
                         ids=lambda x: x if isinstance(x, int) else
                         "-".join(x[:2]) + "-kept" * x[2] + f"-{x[3]}" + "-lora" * bool(x[4]))
def test_every_rank_matches_the_one_process_plan(world, case, ranks):
    family, how, keep, name, ft = case
    d, s = KEEP if keep else STEADY, parse(name)
    plan = shard.rank_ledger(tiny_config(family), BATCH, SEQ, world, how, s, CPU, d, ft)
    one = shard.rank_ledger(tiny_config(family), BATCH, SEQ, 1, "ddp", s, CPU, d, ft)  # one device
    want = lines(plan)
    assert plan.ledger.source == "fake-tensor" and want["collective"] > 0
    if ft is not None:  # sharded weights at rest; at tiny size the gathered blocks outweigh the tiny LoRA state
        assert plan.ledger.total("load") < one.ledger.total("load")
    elif how == "fsdp2":  # sharded: less than one device; gathered: the root's and one block's, all freed by the end
        root, blocks = unsharded_bytes(family)
        block = max(blocks)
        assert plan.ledger.total("load") < one.ledger.total("load") and plan.peak < one.peak
        assert want["gathered"] == want["most_gathered"] == root + block
        assert plan.gathered["load"] == plan.gathered["zero_grad"] == 0
        assert want["collective"] >= block
    else:  # replicas plus a copy of every gradient in the buckets
        root, blocks = unsharded_bytes(family)
        assert want["gathered"] == 0 and plan.peak == one.peak + root + sum(blocks)
    for rank, (peaks, peak, finite, source, gathered, classes, collective) in ranks(world)[case].items():
        assert source == "tracked-cpu" and finite and gathered["zero_grad"] == 0
        for line in LINES:
            diff = {x: {c: v - plan.classes[x][c] for c, v in classes[x].items() if v != plan.classes[x][c]}
                    for x in classes}
            assert abs(peaks[line] - want[line]) <= TOL * max(want[line], 1), (case, world, rank, line, diff,
                                                                                 collective, plan.collective)
        assert abs(peak / plan.peak - 1) <= TOL, (case, world, rank, peak, plan.peak)


@pytest.mark.parametrize("how", shard.SHARDINGS)
def test_the_plan_of_rank_0_is_its_rank_ledger_in_every_worker(how):
    """``bp-mech plan --gpus 2 --shard ...``: each row is ``rank_ledger``'s, the same traced in forked workers
    (which inherit the fake process group) as in one process."""
    from bp_mech.planner import plan as planner

    some = [PLAIN, parse("checkpoint-all"), parse("fp16")]
    one = planner.plan(tiny_config(), BATCH, SEQ, 2**30, candidates=some, options=CPU, gpus=2, shard=how)
    two = planner.plan(tiny_config(), BATCH, SEQ, 2**30, candidates=some, options=CPU, gpus=2, shard=how, workers=2)
    for row, other, s in zip(one.rows, two.rows, some):
        r = shard.rank_ledger(tiny_config(), BATCH, SEQ, 2, how, s, CPU)
        assert row.peak == other.peak == r.peak and row.sharded == other.sharded == dict(r.most), (how, s.name)


@pytest.mark.parametrize("args,message", [(("--gpus", "2"), "go together"), (("--shard", "fsdp2"), "go together"),
                                          (("--gpus", "0", "--shard", "ddp"), "--gpus must be >= 1")])
def test_bad_sharding_is_one_line_and_exit_2(capsys, args, message):
    from bp_mech import cli

    rc = cli.main(["plan", "--workload", "tiny-b2s32", "--budget", "1GiB", "--workers", "1", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and message in err[-1], err


def test_the_command_shows_the_sharded_lines(capsys):
    from bp_mech import cli

    rc = cli.main(["plan", "--workload", "tiny-b2s32", "--budget", "1GiB", "--workers", "1", "--gpus", "2",
                   "--shard", "fsdp2"])
    out = capsys.readouterr().out
    assert rc == 0 and "rank 0 of 2 GPUs, fsdp2, batch 2 per GPU (global 4)" in out
    head = next(line for line in out.splitlines() if line.startswith("strategy "))
    assert head.split()[-2:] == ["gathered", "collective"]
