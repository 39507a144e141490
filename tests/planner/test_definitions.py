"""``planner.definitions`` on the one step (``lifecycle.Session.step``): each definition changes the ledger as its
account says, counted independently (parameters from the config, the logits from B, T and V, the batch
from its int64 ids), and the fake step equals the real tracked one under every definition."""

import pytest
import torch

from bp_mech.planner import lifecycle
from bp_mech.planner.definitions import STEADY, StepDefinition as D, StepLedger
from bp_mech.bench.step import train_step
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import PLAIN, parse
from bp_mech.instruments.workload import ARCHITECTURES, build_model, make_batches, param_count, parse_workload

TINY = parse_workload("tiny-b2s64")
B, T, V = TINY.batch, TINY.seq, ARCHITECTURES["tiny"]["vocab_size"]
FUSED = StepOptions(adamw="fused").for_device("cpu")  # the fused AdamW of the CUDA step, on the CPU
N = param_count("tiny")  # parameters, from the config's fields
BATCH = 2 * 8 * B * T  # input_ids and labels, int64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fake():
    return lifecycle.Session(TINY, fake=True, options=FUSED)


def _tensors(s) -> int:
    return len(list(s.model.parameters()))


def _buffers(s) -> int:
    return sum(b.nbytes for b in s.model.buffers())


def _classes(led: StepLedger, cls: str) -> dict[str, int]:
    return {st: c[cls] for st, c in led.ledger.stages.items()}


def test_the_steady_state_starts_with_weights_moments_and_batch(fake):
    a = fake.step(PLAIN)
    moments = 2 * 4 * N + 4 * _tensors(fake)  # exp_avg, exp_avg_sq and a float32 step per tensor (fused)
    assert a.definition == STEADY and a.start == 4 * N + _buffers(fake) + moments + BATCH
    assert a.increment == a.peak - a.start and a.ledger.updates == 2  # the session's moment update + this one
    assert a.ledger.total("zero_grad") == a.start + 4  # steady: it ends where it started, + the loss it returns


def test_the_first_step_allocates_the_moments_inside_its_update(fake):
    b = fake.step(PLAIN, D("first"))
    moments = 2 * 4 * N + 4 * _tensors(fake)
    states = _classes(b, "optimizer_states")
    assert b.start == 4 * N + _buffers(fake) + BATCH and b.ledger.updates == 1
    assert states["backward"] == 0 and states["optimizer_peak"] == states["zero_grad"] == moments
    assert b.ledger.total("optimizer_peak") >= b.start + 4 * N + moments  # gradients and moments at once
    assert b.ledger.total("zero_grad") == b.start + moments + 4  # (+ the loss it returns)


def test_forward_and_backward_only_have_no_optimizer_line(fake):
    b, c = fake.step(PLAIN, D("first")), fake.step(PLAIN, D("none"))
    assert set(_classes(c, "optimizer_states").values()) == {0} and c.ledger.updates == 0
    assert c.ledger.stages["optimizer_peak"] == c.ledger.stages["backward"]
    assert c.ledger.stages["backward"]["gradients"] == 4 * N and c.ledger.total("zero_grad") == c.start + 4
    for st in ("load", "forward", "backward_peak", "backward"):  # the same program up to the update
        assert c.ledger.stages[st] == b.ledger.stages[st]
    assert c.start == b.start and c.ledger.forward_peak == b.ledger.forward_peak


@pytest.mark.parametrize("strategy,width", [("plain", 4), ("fp16", 2)])
def test_kept_outputs_hold_the_logits_through_the_step(fake, strategy, width):
    """The logits (B, T, V) stay alive from the forward's end to the step's end; at the start the last
    step's outputs (its logits and its loss) are alive until the new forward has run."""
    s = parse(strategy)
    a, d = fake.step(s), fake.step(s, D(keep_outputs=True))
    logits = width * B * T * V  # float32, or float16 under autocast (lm_head's output)
    kept = {st: d.ledger.stages[st]["logits_loss"] - a.ledger.stages[st]["logits_loss"] for st in a.ledger.stages}
    assert kept == dict(load=0, **dict.fromkeys(list(kept)[1:], logits))
    assert d.start - a.start == logits + 4 and d.ledger.peak - a.ledger.peak == logits


def test_half_weights_are_two_bytes_and_so_are_gradients_and_moments():
    e = lifecycle.Session(TINY, fake=True, options=FUSED, definition=D(weights="bfloat16"))
    assert e.dtype == torch.bfloat16
    led = e.step(PLAIN).ledger
    assert led.stages["load"]["parameters"] == 2 * N + _buffers(e)
    assert led.stages["backward"]["gradients"] == 2 * N
    assert led.stages["zero_grad"]["optimizer_states"] == 2 * 2 * N + 4 * _tensors(e)  # (float32 steps)
    with pytest.raises(ValueError, match="weights"):
        e.step(PLAIN, STEADY)  # the weights are the session's


def test_foreach_adamw_holds_one_temporary_per_tensor_during_the_update(fake):
    """foreach: ``exp_avg_sq.sqrt()`` of every tensor at once before ``addcdiv_``; fused: in place."""
    a, g = fake.step(PLAIN), fake.step(PLAIN, D(adamw="foreach"))
    diff = {k: g.ledger.stages["optimizer_peak"][k] - v for k, v in a.ledger.stages["optimizer_peak"].items()}
    assert diff == dict.fromkeys(diff, 0) | {"other": 4 * N} and g.start == a.start


DEFINITIONS = [STEADY, D("first"), D("none"), D(keep_outputs=True), D(adamw="foreach"), D("first", keep_outputs=True),
               D("none", keep_outputs=True)]


@pytest.mark.parametrize("d", DEFINITIONS, ids=lambda d: d.name)
def test_the_fake_step_is_the_real_step_under_every_definition(fake, d):
    real = lifecycle.Session(TINY, "cpu", options=FUSED)
    for name in ("plain", "checkpoint-all", "offload", "micro2"):
        f, r = fake.step(parse(name), d), real.step(parse(name), d)
        assert r.ledger.source == "tracked-cpu" and r.ledger.finite
        assert (f.ledger.stages, f.ledger.forward_peak, f.start) == (r.ledger.stages, r.ledger.forward_peak, r.start)
        assert f.ledger.updates == r.ledger.updates  # steady: a warm-up (real) or the session's update (fake)


def test_the_fake_half_weights_step_is_the_real_one_but_for_the_rope_buffer():
    """The fake model is built in bfloat16, its RoPE ``inv_freq`` buffer computed in float32; the real one is
    cast to bfloat16 whole, that buffer too: the only difference."""
    d = D("first", weights="bfloat16")
    fake, real = (lifecycle.Session(TINY, dev, fake=dev is None, options=FUSED, definition=d) for dev in (None, "cpu"))
    buffers = _buffers(fake) - _buffers(real)
    assert buffers == 4 * 16 // 2  # 16 frequencies (head_dim / 2), 4 against 2 bytes
    f, r = fake.step(PLAIN), real.step(PLAIN)
    assert {k: f.ledger.total(k) - r.ledger.total(k) for k in f.ledger.stages} == dict.fromkeys(f.ledger.stages, buffers)


def test_train_step_keeps_the_outputs_as_a_loop_variable_would():
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kept = []
    train_step(model, opt, batch, parse("micro2"), outputs=kept)
    assert len(kept) == 1 and kept[0].logits.shape == (B // 2, T, V)  # the last micro-batch's
    first = kept[0].logits
    train_step(model, opt, batch, PLAIN, outputs=kept)
    assert kept[0].logits.shape == (B, T, V) and kept[0].logits is not first


def test_definitions_are_checked_and_named():
    assert D("first", keep_outputs=True, weights="float16", adamw="foreach").name == \
        "first-step+outputs-kept+float16-weights+foreach-adamw"
    for bad in (dict(moments="last"), dict(weights="float8"), dict(adamw="sgd"), dict(moments="none", adamw="fused")):
        with pytest.raises(ValueError):
            D(**bad)
    assert StepOptions().for_device("cuda").autocast == "cuda" and StepOptions().for_device("cpu").autocast == "cpu"
    with pytest.raises(ValueError, match="autocast"):
        StepOptions(autocast="xla")
