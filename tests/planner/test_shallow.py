"""``planner.shallow``: the stack cut shallow only where it is one repeated block (a stack whose layers differ,
a freeze by block and Jamba's mamba and attention layers are traced at full depth), the recording tracker's
log of a step (births and frees, operators, phases, marks, in order), one recording class per tracker class,
and a session's tracker given back after a step traced by another (``Session.tracking``), even when it fails.
The extrapolation from these sessions is exact: test_depth.py and test_depth_modes.py."""

import pytest

from bp_mech.bench.strategy import PLAIN, parse
from bp_mech.instruments.tracking import StorageTracker
from bp_mech.planner import depth, plan, shallow
from bp_mech.planner.finetune import FineTune
from bp_mech.planner.shard_tracking import ShardTracker
from tests.planner.test_depth import CUDA, config
from tests.planner.test_plan import FAMILY_FIELDS, TINY

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_period_is_two_only_for_checkpointing_every_second_block():
    assert [shallow.period(parse(n)) for n in ("plain", "checkpoint-every2", "checkpoint-all+offload", "micro2")] \
        == [1, 2, 1, 1]


def test_a_stack_whose_layers_differ_is_traced_at_full_depth():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen2", **dict(TINY, **FAMILY_FIELDS["qwen2"], num_hidden_layers=6,
                                               use_sliding_window=True, max_window_layers=3))
    assert len(set(cfg.layer_types)) == 2 and depth.shallow(cfg, 2) is None
    alike = config("qwen2", 6)
    assert depth.shallow(alike, 3).num_hidden_layers == 3 and len(depth.shallow(alike, 3).layer_types) == 3
    frozen = plan.session(alike, 2, 32, CUDA, finetune=FineTune(freeze=r"layers\.0\."))
    assert shallow.shallow_sessions(frozen, alike, None, [PLAIN]) == {}  # frozen by block
    jamba = AutoConfig.for_model("jamba", **dict(TINY, num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=3,
                                                 expert_layer_period=2, expert_layer_offset=1, num_experts=2))
    sess = plan.session(jamba, 2, 32, CUDA)  # (mamba and attention layers, every second one with experts)
    assert shallow.shallow_sessions(sess, jamba, None, [PLAIN]) == {}


def test_a_block_frozen_or_shaped_otherwise_has_another_signature():
    sess = plan.session(config("qwen2", 3), 2, 32, CUDA)
    blocks = depth_blocks(sess)
    assert shallow.signature(blocks[0]) == shallow.signature(blocks[2])  # (the layer index aside)
    next(blocks[1].parameters()).requires_grad_(False)
    assert shallow.signature(blocks[1]) != shallow.signature(blocks[0])


def depth_blocks(sess):
    from bp_mech.instruments import anatomy

    return anatomy.decoder_blocks(sess.model)


def test_the_recording_logs_a_step_in_order_and_the_session_keeps_its_tracker():
    sess = plan.session(config("qwen2", 2), 2, 32, CUDA)
    assert shallow.recording(StorageTracker) is shallow.recording(StorageTracker)  # one class per tracker class
    assert shallow.recording(ShardTracker) is not shallow.recording(StorageTracker)
    led, rows = shallow.shallow_trace(sess, PLAIN, None, None, 1)
    assert led == sess.ledger(PLAIN) and sess.tracker is StorageTracker
    assert rows == depth.rows(_recorded(sess))
    opened = [r[1] for r in _recorded(sess).log if r[0] == "S"]
    assert opened[:3] == ["forward", "backward", "optimizer"] and "zero_grad" in opened
    kinds = {r[0] for r in _recorded(sess).log}
    assert {"B", "F", "O", "S", "M"} <= kinds


def _recorded(sess):
    made = []

    def new(device):
        made.append(tr := shallow.recording(StorageTracker)(device))
        return tr

    with sess.tracking(new):
        sess.ledger(PLAIN)
    return made[-1]


def test_a_step_that_fails_under_another_tracker_gives_the_session_its_own_back():
    sess = plan.session(config("qwen2", 2), 2, 32, CUDA)

    def broken(device):
        raise RuntimeError("no tracker today")

    with pytest.raises(RuntimeError, match="no tracker today"), sess.tracking(broken):
        sess.ledger(PLAIN)
    assert sess.tracker is StorageTracker


def test_a_family_cut_shallow_is_the_same_model_with_fewer_blocks():
    cfg = config("llama", 8)
    cut = depth.shallow(cfg, 3)
    assert cut.num_hidden_layers == 3 and cfg.num_hidden_layers == 8
    assert {k: v for k, v in cut.to_dict().items() if k != "num_hidden_layers"} == \
        {k: v for k, v in cfg.to_dict().items() if k != "num_hidden_layers"}


def test_the_tries_start_at_depth_one_except_under_fsdp2():
    every2 = parse("checkpoint-every2")
    assert shallow.tries(8, PLAIN) == [(1, 2, 3), (2, 3, 4)] and shallow.tries(8, every2) == [(2, 4, 6)]
    assert shallow.tries(9, every2) == [(1, 3, 5), (3, 5, 7)]
    assert shallow.tries(8, PLAIN, "fsdp2") == [(2, 3, 4)] and shallow.tries(8, PLAIN, "ddp")[0] == (1, 2, 3)
    assert shallow.tries(4, PLAIN) == [(1, 2, 3)] and shallow.tries(3, PLAIN) == []


@pytest.mark.parametrize("family,name,traces", [("qwen2", "checkpoint-all", [1, 2, 3]),
                                                ("bloom", "plain", [1, 2, 3]), ("bloom", "checkpoint-all", [1, 2, 3, 4])])
def test_depth_one_serves_where_it_steps_evenly_and_depth_four_is_traced_only_where_not(family, name, traces,
                                                                                       monkeypatch):
    cfg = config(family)
    make = lambda c: plan.session(c, 2, 32, CUDA)  # noqa: E731
    cut = shallow.shallow_sessions(make(cfg), cfg, make, [PLAIN])
    assert sorted(cut) == [1, 2, 3, 4]
    made, trace = [], shallow.shallow_trace
    monkeypatch.setattr(shallow, "shallow_trace", lambda sess, *a: made.append(
        sess.model.config.get_text_config().num_hidden_layers) or trace(sess, *a))
    # (bloom's checkpointed step from depth 1 does not step evenly; either way equal to the full trace: test_depth)
    assert shallow.extrapolated(cut, 8, parse(name)) is not None and made == traces
