"""Part 02 · 56: the properties the engine derives for the chapter's checks (the model's mode given back, also
when it raises; non-contiguous inputs; exact types; refused inputs) and the outsider's wrong solutions: each is
rejected, with its message."""

import math

import pytest
import torch
from conftest import ROOT, load_solution, mutant

from bp_mech import continual_eval, training_state as ts
from bp_mech.checks import ex56

pytestmark = pytest.mark.usefixtures("one_thread")
A = load_solution(ROOT / "answers", "ex56_continual_pretrain")


def _solution(**over):
    return mutant("ex56_continual_pretrain", **over)


def _loss_by_hand(model, batches, restore_on_raise=True, restore=True):
    was = model.training
    model.eval()
    try:
        tot, n = 0.0, 0
        with torch.no_grad():
            for b in batches:
                z, y = model(input_ids=b["input_ids"]).logits[:, :-1].double(), b["labels"][:, 1:]
                tot += torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100,
                                                         reduction="sum").item()
                n += int((y != -100).sum())
    except Exception:
        if restore_on_raise:
            model.train(was)
        raise
    if restore:
        model.train(was)
    return tot / n


def _ids_view(model, batches):  # input_ids.view(-1): contiguous inputs only
    return continual_eval.token_loss(model, [dict(b, input_ids=b["input_ids"].view(-1).view(b["input_ids"].shape))
                                             for b in batches])


@pytest.mark.parametrize("bad, needle", [
    (lambda m, b: _loss_by_hand(m, b, restore=False), r"token_loss: left the model.training changed \(True before"),
    (lambda m, b: _loss_by_hand(m, b, restore_on_raise=False),
     r"token_loss: left the model.training changed .*also when raising.* \(logits of scale 4\)"),
    (_ids_view, r"token_loss: raised RuntimeError at batches as non-contiguous .* views"),
], ids=["leaves-eval-mode", "eval-mode-after-raise", "contiguous-ids-only"])
def test_token_loss_engine_properties(bad, needle):
    with pytest.raises(AssertionError, match=needle):
        ex56.check_token_loss(_solution(token_loss=bad))


class _FloatRule(A.ReplayStream):  # q = replay / period as a float: floor(55 * 3 / 11) = 14
    def is_old(self, g):
        q = self.replay / self.period
        return math.floor((g + 1) * q) > math.floor(g * q)


class _IntFlags(A.ReplayStream):
    def next(self):
        out = super().next()
        return dict(out, replayed=out["replayed"].long())


class _HalfValidation(A.ReplayStream):  # replay > period accepted
    def __init__(self, new, old, batch, replay, period):
        if replay < 0 or period < 1 or batch < 1:
            raise ValueError("bad")
        self.new, self.old, self.batch, self.replay, self.period, self.position = new, old, batch, replay, period, 0


class _LoadNoPosition(A.ReplayStream):
    def load_state_dict(self, state):
        self.new.load_state_dict(state["new"])
        self.old.load_state_dict(state["old"])


class _RowsPosition(A.ReplayStream):  # position counts rows
    def next(self):
        out = super().next()
        self.position += self.batch - 1
        return out


@pytest.mark.parametrize("check, cls, needle", [
    (ex56.check_ReplayStream, _FloatRule, r"input_ids\[10\] differs .* replay 3, period 11"),
    (ex56.check_ReplayStream, _IntFlags, "'replayed' is tensor.*, expected a bool tensor"),
    (ex56.check_ReplayStream, _HalfValidation, "replay 4 of every 3 rows, expected ValueError"),
    (ex56.check_ReplayStream__resume, _LoadNoPosition, r"input_ids\[0\] differs .*resume True"),
    (ex56.check_ReplayStream, _RowsPosition, r"input_ids\[1\] differs"),
], ids=["float-rule", "int-flags", "replay-above-period", "load-forgets-position", "position-counts-rows"])
def test_replay_stream_outsiders_rejected(check, cls, needle):
    with pytest.raises(AssertionError, match=needle):
        check(_solution(ReplayStream=cls))


def test_predict_with_a_float_q_is_rejected():
    with pytest.raises(AssertionError, match=r"the prediction is 28, .* gives 30 at updates 11"):
        ex56.check_predict_replay_tokens(_solution(predict_replay_tokens=lambda u, B, T, r, p: math.floor(
            u * B * (r / p)) * T))


def test_capture_that_moves_the_global_rng_is_rejected():
    def capture(t):
        torch.manual_seed(0)
        return ts.capture_state(t)
    with pytest.raises(AssertionError, match="restore_state: torch's global RNG state differs from the capture's"):
        ex56.check_restore_state(_solution(capture_state=capture))


def test_a_loss_evaluated_with_gradients_is_rejected():
    def with_grad(model, batches):
        with torch.enable_grad():
            return continual_eval.token_loss.__wrapped__(model, batches)
    with pytest.raises(AssertionError, match="token_loss: the model ran with gradients enabled"):
        ex56.check_token_loss(_solution(token_loss=with_grad))


class _IdentityRule(A.ReplayStream):  # `is not`: right while CPython caches the small ints, wrong above 256
    def is_old(self, g):
        return (g + 1) * self.replay // self.period is not g * self.replay // self.period


def test_a_rule_comparing_int_identity_is_rejected():
    with pytest.raises(AssertionError, match=r"differs .* at batch 64, replay 3, period 4"):
        ex56.check_ReplayStream(_solution(ReplayStream=_IdentityRule))
