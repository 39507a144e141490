"""Answers for Part 02 · 56: the package's implementation (``src/bp_mech/continual_pretrain.py`` and
``src/bp_mech/training_state.py``); the replay mix and the prediction are written here."""

import torch

from bp_mech.continual_eval import token_loss  # noqa: F401
from bp_mech.training_state import capture_state, restore_state  # noqa: F401


class ReplayStream:
    """New-domain batches with replay / period old-domain rows, evenly spread."""

    def __init__(self, new, old, batch: int, replay: int, period: int) -> None:
        if batch < 1 or period < 1 or not 0 <= replay <= period:
            raise ValueError(f"a replay mix needs batch >= 1, 0 <= replay <= period: "
                             f"got {batch}, {replay}, {period}")
        self.new, self.old = new, old
        self.batch, self.replay, self.period = batch, replay, period
        self.position = 0

    def is_old(self, g: int) -> bool:
        """Row g is replayed iff floor(n q) steps up between n = g and n = g + 1."""
        return (g + 1) * self.replay // self.period > g * self.replay // self.period

    def next(self) -> dict:
        g0 = self.position * self.batch
        old = [self.is_old(g0 + i) for i in range(self.batch)]
        rows = [(self.old if o else self.new).next()["input_ids"][0] for o in old]
        x = torch.stack(rows)  # (B, T)
        self.position += 1
        return {"input_ids": x, "labels": x.clone(), "replayed": torch.tensor(old)}

    def state_dict(self) -> dict:
        return {"position": self.position, "new": self.new.state_dict(),
                "old": self.old.state_dict()}  # TextStream's state_dict copies

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.new.load_state_dict(state["new"])  # copies the generator state
        self.old.load_state_dict(state["old"])


def predict_replay_tokens(updates: int, batch: int, seq: int, replay: int,
                          period: int) -> int:
    """The first N batches are the first n = N B rows; the stream's rule counts over the
    whole run, so floor(n q) of them are old-domain rows (not N floor(B q): the floor
    is not per batch), each of T tokens."""
    rows = updates * batch
    return rows * replay // period * seq  # floor(n q) replayed rows of seq tokens
