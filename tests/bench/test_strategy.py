"""Composable strategies (``bp_mech.bench.strategy``) under the one step (``bench.step.train_step``): names round-trip, every mechanism switches off to a
no-op and is undone after its block, and every pair of mechanisms leaves loss and gradients equal to
the plain step within what the pair allows: bitwise where no operation changes (checkpointing,
offload), float32 reordering where sums are split (accumulation, chunked loss), 16-bit rounding under
autocast; a pair with autocast is also compared with autocast alone, where checkpointing and offload
change nothing at all."""

import contextlib
import copy
import itertools

import pytest
import torch

from bp_mech import accumulation, checkpointing, chunked_head, chunked_loss
from bp_mech.bench import strategy as S
from bp_mech.bench.step import train_step
from bp_mech.instruments.workload import build_model, make_batches, parse_workload

W = parse_workload("tiny-b4s32")
CHUNK = 24  # tokens per chunk: 4 x 32 tokens split unevenly (5 full chunks and a short one)

# One entry per mechanism setting; a pair combines two different mechanisms.
MECHANISMS = {"checkpoint": [dict(checkpoint=c) for c in checkpointing.CONFIGURATIONS[1:]],
              "offload": [dict(offload=True)], "amp": [dict(amp="float16"), dict(amp="bfloat16")],
              "accumulation": [dict(micro_batches=2)], "chunked_loss": [dict(chunked_loss=CHUNK)]}
PAIRS = [S.Strategy(**a, **b) for m1, m2 in itertools.combinations(MECHANISMS, 2)
         for a in MECHANISMS[m1] for b in MECHANISMS[m2]]
SINGLES = [S.Strategy(**a) for settings in MECHANISMS.values() for a in settings]

# (loss, gradient) relative tolerances against the plain float32 step on the CPU:
EXACT = (0.0, 0.0)  # checkpointing and offload run the same operations on the same values
REORDER = (1e-5, 1e-4)  # float32 sums split into parts (eps 1.2e-7, a few thousand terms per sum)
HALF = {"float16": (1e-3, 2e-2), "bfloat16": (1e-2, 6e-2)}  # autocast: eps 9.8e-4 / 7.8e-3 per rounding


def tolerance(s: S.Strategy) -> tuple[float, float]:
    if s.amp:
        return HALF[s.amp]
    if s.micro_batches > 1 or s.chunked_loss is not None:
        return REORDER
    return EXACT


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread


@pytest.fixture(scope="module")
def setup():
    model = build_model(W)
    batch = make_batches(W, 1)[0]
    batch["labels"][1, 20:] = chunked_loss.IGNORE  # padding: micro-batches hold different target counts
    return model, batch


def step(setup, s: S.Strategy):
    """Loss and gradients of one train_step under ``s`` without its update (the gradients stay; unscaled
    under fp16)."""
    model, batch = setup
    model = copy.deepcopy(model)
    r = train_step(model, None, batch, s, update=False)
    return r.loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def references(setup):
    return {None: step(setup, S.PLAIN), **{a: step(setup, S.Strategy(amp=a)) for a in S.LowPrecision}}


def errors(got, ref):
    loss = abs(got[0] - ref[0]) / abs(ref[0])
    grad = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got[1], ref[1]))
    return loss, grad


def _check(setup, references, s):
    got = step(setup, s)
    loss_err, grad_err = errors(got, references[None])
    loss_tol, grad_tol = tolerance(s)
    assert loss_err <= loss_tol and grad_err <= grad_tol, (s.name, loss_err, grad_err)
    if s.amp and tolerance(s.replace(amp=None)) == EXACT:  # checkpointing / offload under autocast
        assert errors(got, references[s.amp]) == (0.0, 0.0), s.name
    return loss_err, grad_err


@pytest.mark.parametrize("s", SINGLES + PAIRS, ids=lambda s: s.name)
def test_every_single_and_pair_matches_the_plain_step(setup, references, s):
    loss_err, grad_err = _check(setup, references, s)
    if s.amp:  # 16-bit rounding is visible: the comparison sees a real difference
        assert grad_err > 0


@pytest.mark.parametrize("s", [c for c in S.CANDIDATES if sum(
    (c.checkpoint != "plain", c.offload, c.amp is not None, c.micro_batches > 1, c.chunked_loss is not None)) > 2],
    ids=lambda s: s.name)
def test_the_planned_combinations_of_three_and_more_match_the_plain_step(setup, references, s):
    _check(setup, references, s)


def test_accumulation_is_token_weighted(setup, references):
    """With padding the micro-batches hold different target counts: the mean of micro-batch means is
    off by far more than the tolerance, the token-weighted sum is the full batch's loss."""
    model, batch = setup
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    accumulation.accumulated_backward(model, batch, 2, "naive")
    naive = errors((0.0, [p.grad for p in model.parameters()]), (1.0, references[None][1]))[1]
    assert naive > 100 * REORDER[1]
    assert errors(step(setup, S.Strategy(micro_batches=2)), references[None])[1] <= REORDER[1]


def test_names_round_trip():
    for s in (*S.CANDIDATES, *SINGLES, *PAIRS):
        assert S.parse(s.name) == s
    assert S.PLAIN.name == "plain" and S.parse("plain") == S.Strategy()
    assert S.parse("fp16+checkpoint-all") == S.Strategy(checkpoint="checkpoint-all", amp="float16")
    assert S.parse("chunked-loss").chunked_loss == chunked_loss.DEFAULT_CHUNK
    assert S.parse("checkpoint-all+offload+fp16+chunked-loss").name == "checkpoint-all+offload+fp16+chunked-loss"
    assert len(set(S.CANDIDATES)) == len(S.CANDIDATES) == 1 + len(S.SINGLES) + len(S.COMBINATIONS)


def test_one_vocabulary_for_the_low_precisions():
    """The strategy's ``amp``, its word in the name, its torch dtype and a record's label come from one
    member of ``LowPrecision``: no table translates between them."""
    import json

    import torch

    for p, word, dtype in ((S.LowPrecision.FP16, "fp16", torch.float16), (S.LowPrecision.BF16, "bf16", torch.bfloat16)):
        s = S.parse(word)
        assert s.amp is p and s == S.Strategy(amp=p.value) and s.name == word and s.low is dtype
        assert s.dtype_label == f"{p.value}-autocast" and json.loads(json.dumps(s.fields()))["amp"] == p.value
    assert S.PLAIN.low is None and S.PLAIN.dtype_label == "float32" and S.LowPrecision.words() == ("fp16", "bf16")
    with pytest.raises(ValueError, match="unknown amp dtype 'float8'"):
        S.Strategy(amp="float8")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        S.LowPrecision.of_word("fp8")


@pytest.mark.parametrize("bad", ["checkpoint", "fp16+bf16", "micro1", "micro", "offload+offload", "chunked-loss-x",
                                 "plain+fp16", ""])
def test_bad_names_are_refused(bad):
    with pytest.raises(ValueError):
        S.parse(bad)


def test_off_switches_are_null_contexts(setup):
    model, batch = setup
    assert isinstance(checkpointing.configure(model, "plain"), contextlib.nullcontext)
    assert isinstance(chunked_head.chunked(model, None), contextlib.nullcontext)
    assert isinstance(accumulation.token_weighted(batch, 1), contextlib.nullcontext)
    with S.enter(model, S.PLAIN) as ctx:
        assert ctx.offload is None and not ctx.scaler.is_enabled()


def test_applied_is_undone_after_its_block(setup):
    model, batch = setup
    model = copy.deepcopy(model)
    head, names = model.lm_head, [n for n, _ in model.named_parameters()]
    s = S.parse("checkpoint-mlp+offload+fp16+chunked-loss")
    with S.enter(model, s) as ctx:
        assert isinstance(model.lm_head, chunked_head.ChunkedHead) and model(**batch).logits is None
        assert ctx.offload is not None and ctx.scaler.is_enabled()
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, s, entered=ctx)
        assert ctx.d2h_bytes > 0 and ctx.d2h_bytes == ctx.h2d_bytes
    assert model.lm_head is head and "forward" not in vars(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert not any(type(layer.mlp).__name__ == "_Checkpointed" for layer in model.model.layers)
    assert model(**batch).logits.shape == (*batch["input_ids"].shape, model.config.vocab_size)


def test_a_step_refuses_micro_batches_that_do_not_divide_the_batch(setup):
    model, batch = setup
    with pytest.raises(ValueError, match="divide"):
        train_step(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), batch,
                   S.Strategy(micro_batches=3))
