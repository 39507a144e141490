"""``planner.depth``: a step's ledger extrapolated in depth from three shallow traces equals the full-depth
trace's to the byte, on every validated family, for the strategies whose steps differ most (checkpointing
every second block: period 2; offload, fp16, chunked loss together), and in the loop that keeps the outputs;
a stack whose blocks differ is traced at full depth. Every mode and both shardings: test_depth_modes.py."""

import contextlib

import pytest

from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import PLAIN, parse, unsupported
from bp_mech.planner import depth, plan, shallow, shard as sharding, trace
from bp_mech.planner.costs import flops_by_depth, forward_flops
from bp_mech.planner.definitions import STEADY
from tests.planner.test_plan import FAMILY_FIELDS, TINY

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = StepOptions().for_device("cuda")
DIFFERENT = ("plain", "checkpoint-every2", "checkpoint-all+offload+fp16+chunked-loss")
LAYERS = 8  # > a + 2p for both periods: depths (2, 3, 4) and (2, 4, 6)


def config(family: str, layers: int = LAYERS):
    from transformers import AutoConfig

    kw = dict(TINY, **FAMILY_FIELDS[family], num_hidden_layers=layers)
    if "n_layer" in kw:
        kw["n_layer"] = layers
    return AutoConfig.for_model(family, **kw)


def compare(family, names=DIFFERENT, shard=None, gpus=1, options=CUDA, definition=STEADY, finetune=None,
            layers=LAYERS):
    """Each named strategy's extrapolated ledger against its full-depth trace: the names that differ or
    did not extrapolate (an empty list: every one equal, none traced at full depth)."""
    cfg = config(family, layers)
    bad = []
    with sharding.planning(shard, gpus) if shard else contextlib.nullcontext((None, None)) as (prepare, full):
        make = lambda c: plan.session(c, 2, 32, options, definition, finetune, prepare)  # noqa: E731
        sess = make(cfg)
        todo = [s for s in map(parse, names) if not unsupported(sess.model, s) and not (definition.weights and s.amp)]
        counted = {}
        cut = shallow.shallow_sessions(sess, cfg, make, todo, shard, gpus, counted)
        if flops_by_depth(counted, layers) != forward_flops(sess):  # (the plan counts its FLOPs on the shallow ones)
            bad.append("forward FLOPs")
        for task in [*todo, (PLAIN, definition.replace(keep_outputs=not definition.keep_outputs))]:
            s, d = task if isinstance(task, tuple) else (task, None)
            got = shallow.extrapolated(cut, layers, task, shard, gpus)
            want = sharding.tracked(sess, s, d, "ddp", gpus) if shard == "ddp" else trace.traced(sess, full, task)
            if got is None or got != want:
                bad.append(f"{s.name}{'/other loop' if d else ''}: {'not extrapolated' if got is None else 'differs'}")
    return bad


@pytest.mark.parametrize("family", list(FAMILY_FIELDS))
def test_every_family_extrapolates_to_the_full_trace(family):
    assert compare(family) == []


def test_depths():
    assert depth.depths(8, 1) == (2, 3, 4) and depth.depths(8, 2) == (2, 4, 6) and depth.depths(9, 2) == (3, 5, 7)
    assert depth.depths(8, 1, 1) == (1, 2, 3) and depth.depths(8, 2, 1) == (2, 4, 6)
    assert depth.depths(4, 1) is None and depth.depths(6, 2) is None  # the full depth is no deeper: traced as is
