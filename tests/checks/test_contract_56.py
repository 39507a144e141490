"""Part 02 · 56: every property the exercise checks hold is broken by one mutant (an otherwise right
solution), and the check rejects it with its message."""

import copy
import math

import pytest
import torch
from conftest import ROOT, load_solution, mutant

from bp_mech import continual_eval, training_state as ts
from bp_mech.checks import ex56
from checks.mutants import as_tensor

pytestmark = pytest.mark.usefixtures("one_thread")
A = load_solution(ROOT / "answers", "ex56_continual_pretrain")


def _solution(**over):
    return mutant("ex56_continual_pretrain", **over)


# --- token_loss -----------------------------------------------------------------------------------

def _modifies_labels(model, batches):
    out = continual_eval.token_loss(model, batches)
    batches[0]["labels"][0, 0] = 3
    return out


def _modifies_model(model, batches):
    out = continual_eval.token_loss(model, batches)
    with torch.no_grad():
        next(model.parameters()).mul_(2.0)
    return out


def _with_view(model, batches):  # logits.view(-1, V): fails on a transposed layout
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            z = model(input_ids=b["input_ids"]).logits  # (B, T, V), labels shifted instead
            y = torch.nn.functional.pad(b["labels"][:, 1:], (0, 1), value=-100)
            total += torch.nn.functional.cross_entropy(z.view(-1, z.shape[-1]), y.reshape(-1), reduction="sum").item()
            count += int((y != -100).sum())
    return total / count


def _log_of_softmax(model, batches):
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            p = torch.softmax(model(input_ids=b["input_ids"]).logits[:, :-1], -1)
            y = b["labels"][:, 1:]
            keep = y != -100
            total -= torch.log(p[keep].gather(-1, y[keep][:, None])).sum().item()
            count += int(keep.sum())
    return total / count


def _weighted_batch_means(model, batches):  # right on batches with targets, 0/0 on an all-ignored one
    n = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    return sum(continual_eval.token_loss(model, [b]) * k for b, k in zip(batches, n)) / sum(n)


def _swallows(model, batches):
    try:
        return continual_eval.token_loss(model, batches)
    except Exception:  # noqa: BLE001
        return math.nan


@pytest.mark.parametrize("bad, needle", [
    (_modifies_labels, r"token_loss: batches\[0\]\['labels'\] was modified in place"),
    (_modifies_model, r"token_loss: model.table was modified in place"),
    (_with_view, r"token_loss: raised RuntimeError at .*transpose view"),
    (_log_of_softmax, r"token_loss: the loss is inf, a float64 sum .* at .*scale 1000"),
    (as_tensor(continual_eval.token_loss), r"token_loss: the loss is a .*tensor.*, expected a float"),
    (_weighted_batch_means, r"token_loss: the loss is nan, .*all-ignored batch"),
    (_swallows, r"token_loss: returned a float for a model that raises .*, expected Broken"),
], ids=["modifies-batches", "modifies-model", "contiguous-only", "log-of-softmax", "tensor-not-float",
        "all-ignored-batch", "swallows-exceptions"])
def test_token_loss_contract_rejects(bad, needle):
    with pytest.raises(AssertionError, match=needle):
        ex56.check_token_loss(_solution(token_loss=bad))


# --- capture_state / restore_state ----------------------------------------------------------------

def _capture_moves_data(t):
    s = ts.capture_state(t)
    t.data.next()
    return s


def _capture_live_stream(t):
    return dict(ts.capture_state(t), data=t.data)


def _restore_live_stream(t, s):
    ts.restore_state(t, dict(s, data=s["data"].state_dict() if not isinstance(s["data"], dict) else s["data"]))


def _restore_swallows(t, s):
    try:
        ts.restore_state(t, s)
    except Exception:  # noqa: BLE001, S110 (the mistake this mutant makes)
        pass


@pytest.mark.parametrize("check, over, needle", [
    (ex56.check_capture_state, {"capture_state": _capture_moves_data},
     "capture_state: modified the trainer: the data position"),
    (ex56.check_restore_state,
     {"capture_state": _capture_live_stream, "restore_state": _restore_live_stream},
     "capture_state: the captured state changed when the trainer trained on"),
    (ex56.check_restore_state,
     {"restore_state": lambda t, s: ts.restore_state(t, s, copy_state=False)},
     "restore_state: the state changed when the restored trainer trained on"),
    (ex56.check_restore_state, {"restore_state": lambda t, s: (ts.restore_state(t, s), s)[1]},
     "restore_state: the return value is a dict, expected a NoneType"),
    (ex56.check_restore_state, {"restore_state": _restore_swallows},
     "restore_state: returned None for the state of a 2-layer model .*, expected FrameworkError"),
], ids=["capture-modifies-trainer", "capture-holds-live-stream", "restore-keeps-references", "restore-returns-state",
        "restore-swallows-errors"])
def test_state_contract_rejects(check, over, needle):
    with pytest.raises(AssertionError, match=needle):
        check(_solution(**over))


# --- the replay mix and its prediction -------------------------------------------------------------

class _FirstRows(A.ReplayStream):  # floor(B q) old rows at the start of every batch: the count drifts
    def is_old(self, g):
        return g % self.batch < self.batch * self.replay // self.period


class _ReplayedList(A.ReplayStream):
    def next(self):
        return dict(super().next(), replayed=[bool(x) for x in super().next()["replayed"]])


class _TensorPosition(A.ReplayStream):
    def __init__(self, *args):
        super().__init__(*args)
        self.position = torch.tensor(0)


class _LiveState(A.ReplayStream):  # state_dict hands out a dict that next() keeps up to date
    def next(self):
        out = super().next()
        if hasattr(self, "live"):
            self.live["position"] = self.position
        return out

    def state_dict(self):
        self.live = super().state_dict()
        return self.live


class _KeepsLoaded(A.ReplayStream):  # load_state_dict keeps the dict and updates it
    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.live = state

    def next(self):
        out = super().next()
        if hasattr(self, "live"):
            self.live["position"] = self.position
        return out


class _ForgetsOld(A.ReplayStream):
    def load_state_dict(self, state):
        self.position = int(state["position"])
        self.new.load_state_dict(state["new"])


class _NoValidation(A.ReplayStream):
    def __init__(self, new, old, batch, replay, period):
        self.new, self.old, self.batch, self.replay, self.period, self.position = new, old, batch, replay, period, 0


@pytest.mark.parametrize("check, cls, needle", [
    (ex56.check_ReplayStream, _FirstRows,
     r"ReplayStream: the batches' input_ids\[1\] differs from a mix drawn row by row"),
    (ex56.check_ReplayStream, _ReplayedList, "ReplayStream: 'replayed' is"),
    (ex56.check_ReplayStream, _TensorPosition, "ReplayStream: position is a .*tensor.*, expected an int"),
    (ex56.check_ReplayStream__resume, _LiveState, "ReplayStream.state_dict: the returned state changed"),
    (ex56.check_ReplayStream__resume, _KeepsLoaded, "ReplayStream.load_state_dict: the loaded state changed"),
    (ex56.check_ReplayStream__resume, _ForgetsOld, r"ReplayStream: the batches' input_ids\[0\] differs .*resume True"),
    (ex56.check_ReplayStream, _NoValidation,
     "ReplayStream: returned a tuple for batch 2, replay 4 of every 3 rows, expected ValueError"),
], ids=["first-rows-per-batch", "replayed-as-list", "tensor-position", "state-not-a-copy", "load-keeps-reference",
        "load-forgets-old-stream", "no-validation"])
def test_replay_stream_checks_reject(check, cls, needle):
    with pytest.raises(AssertionError, match=needle):
        check(_solution(ReplayStream=cls))


PREDICTED = "the prediction is .*, the old-domain tokens counted in a drawn reference mix gives"


@pytest.mark.parametrize("bad, needle", [
    (lambda u, B, T, r, p: u * (B * r // p) * T, PREDICTED),  # floor per batch, not over the run
    (lambda u, B, T, r, p: u * B * r // p, PREDICTED),  # rows, not tokens
    (lambda u, B, T, r, p: round(u * B * r / p) * T, PREDICTED),  # rounded, not floored
    (lambda u, B, T, r, p: float(u * B * r // p * T), "the prediction is a float, expected an int"),
], ids=["per-batch-floor", "rows-not-tokens", "rounded", "float"])
def test_predict_replay_tokens_rejects(bad, needle):
    with pytest.raises(AssertionError, match=needle):
        ex56.check_predict_replay_tokens(_solution(predict_replay_tokens=bad))


def test_the_reference_mix_replays_exactly_floor_n_q_rows():
    batches = ex56.reference_batches(4, 2, 5, 3, (0, 1), 4)  # 12 rows, q = 2/5: floor(12 * 2 / 5) = 4
    assert sum(int(f.sum()) for _, f in batches) == 4 and all((x[f] >= ex56.OLD).all() for x, f in batches)
    assert copy.deepcopy(batches[0][1]).dtype == torch.bool
