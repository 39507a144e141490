"""Exercises for Part 02 · 56 — continual pretraining: the per-token holdout loss, a training state
that resumes bit for bit, and a replay mix of old-domain rows that resumes too.

The trainer the state exercises work on is the package's ``bp_mech.bench.trainer.Trainer``
(built for a phase by ``bench.trainer.phase_trainer``; its ``step`` is the book's one training
step). Its attributes:

* ``model``: a ``transformers`` causal LM (tied embeddings: ``lm_head.weight`` is
  ``model.embed_tokens.weight``);
* ``optimizer``: ``torch.optim.AdamW`` (its state holds ``step``, ``exp_avg``,
  ``exp_avg_sq`` per parameter);
* ``scaler``: a ``torch.amp.GradScaler`` (``state_dict()`` / ``load_state_dict()``); enabled
  under fp16 (the check's trainer runs fp16), disabled in a float32 run (its state is ``{}``);
* ``clock``: a ``bp_mech.scheduler.UpdateClock``, whose plain attributes ``updates``
  (applied updates) and ``skipped`` (skipped optimizer calls) set the learning rate;
* ``data``: a ``bp_mech.continual_data.TextStream``: ``position`` (batches drawn so
  far) and ``generator`` (the ``torch.Generator`` that draws the batches' offsets;
  ``get_state()``/``set_state()``);
* ``device``: where it trains.

Check your solutions with ``bp-mech check 56`` (or ``pytest tests/test_exercises.py -m
ch56 --impl exercises``). The loss is compared with a float64 reference computed
position by position; the state is checked by resuming a run in a fresh trainer (another
random init, another data seed, the global RNG moved) and comparing it bit for bit with
the uninterrupted run.
"""

import torch  # noqa: F401


def token_loss(model, batches) -> float:
    """The mean next-token cross-entropy per target token over several batches.

    In nats per token.

    Math: position t of row b predicts token t + 1. With y = labels,

        L = sum_{b, t : y[b, t+1] != -100} -log softmax(logits[b, t])[y[b, t+1]]
            / #{(b, t) : y[b, t+1] != -100}

    summed over all batches and divided once by the targets of all batches: every target
    token weighs the same, whatever the batch it is in (not the mean of per-batch
    means). A label -100 marks a position that is not a target (padding): it is neither
    in the sum nor in the count. The last position of a row has no next token.

    Args:
        model: called as ``model(input_ids=...)``, returns an object with ``.logits``
            (B, T, V). Evaluate without gradients and in eval mode; leave the model in
            the mode it was in.
        batches: list of dicts with ``input_ids`` and ``labels``, each (B, T) int64 (B
            may differ between batches); move them to the model's device.

    Returns:
        L as a Python float (exactly ``float``, not a tensor; accumulate in float64).

    Contract (checked): the model's weights and the batches are not modified; logits
    that are a non-contiguous view give the same loss; logits of magnitude 1e3 give a
    finite loss (a log-softmax, not log(softmax)); a batch whose labels are all -100
    adds nothing; an exception raised by the model propagates (it is not swallowed).
    """
    raise NotImplementedError("ex56: token_loss")


def capture_state(trainer) -> dict:
    """Everything the trainer's next update depends on, in a dict of your design.

    It must hold the model weights, the optimizer's state, the GradScaler's state, the
    clock's ``updates`` and ``skipped``, the data stream's ``position`` and generator
    state, and the global RNG states (torch's CPU generator, and CUDA's when training on
    CUDA; Python's ``random`` and NumPy's cost nothing to add). Every tensor must be a
    copy: ``state_dict()`` returns the live tensors, which the next update changes in
    place.

    Args:
        trainer: a ``bp_mech.bench.trainer.Trainer`` (see the module docstring).

    Returns:
        A dict that ``restore_state`` can put back.

    Contract (checked): the trainer is not modified; no tensor of the dict shares
    storage with the live model or optimizer, and training on afterwards leaves every
    value of the dict as it was captured.
    """
    raise NotImplementedError("ex56: capture_state")


def restore_state(trainer, state: dict) -> None:
    """Put a ``capture_state`` dict back into ``trainer``.

    ``trainer`` is built the same way as the captured one (same model class and config,
    same optimizer, scaler, clock and data stream classes) but otherwise fresh: another
    random init, new AdamW, clock at 0, stream at position 0, any RNG state.

    Afterwards, training ``trainer`` on must give bit for bit the losses and weights the
    captured trainer gives. Do not keep references into ``state``: copy
    (``optimizer.load_state_dict`` keeps the tensors it is given, and the next update
    would change them in ``state``).

    Args:
        trainer: the fresh ``bp_mech.bench.trainer.Trainer``.
        state: what ``capture_state`` returned.

    Returns:
        None.

    Contract (checked): every piece is put back (weights, AdamW state, scaler, clock,
    data position and generator, global RNG); ``state`` is left as it was, also after
    the restored trainer trains on (so that another trainer can be restored from it);
    an error of a piece that does not fit (a state of another model) propagates.
    """
    raise NotImplementedError("ex56: restore_state")


class ReplayStream:
    """Training batches that replay old-domain rows among the new-domain ones.

    Continual pretraining mixes a fraction q = replay / period of rows of the old
    (general) text into the new domain's batches, to limit forgetting. The mix is
    deterministic. Number the rows of the run g = 0, 1, 2, ... (row i of batch number
    ``position`` is g = position * batch + i). Row g is an old-domain row iff

        floor((g + 1) * replay / period) > floor(g * replay / period),

    which spreads the replayed rows evenly over the run (integer arithmetic: no float
    rounding). Each row is the next batch of the stream it comes from: ``old.next()``
    for a replayed row, ``new.next()`` otherwise, in row order.

    Args:
        new: a ``TextStream`` of the new domain, with batch 1.
        old: a ``TextStream`` of the old domain, with batch 1 and the same seq T.
        batch: rows per batch, B >= 1.
        replay: replayed rows per ``period`` rows, an int, 0 <= replay <= period.
        period: an int >= 1.

    Raises:
        ValueError: if batch < 1, period < 1 or replay is not in [0, period].

    Attributes:
        position: batches drawn so far (a Python int, starts at 0).

    Contract (checked): the rows equal a reference drawn row by row from copies of the
    two streams; ``state_dict()`` is a copy (drawing on changes nothing in it) with
    ``position`` a Python int; ``load_state_dict`` into a stream built from other seeds
    continues bit for bit and keeps no reference into the dict it is given.
    """

    def __init__(self, new, old, batch: int, replay: int, period: int) -> None:
        raise NotImplementedError("ex56: ReplayStream.__init__")

    def next(self) -> dict:
        """The next batch; advances ``position`` by one.

        Returns:
            ``{"input_ids": x, "labels": x.clone(), "replayed": r}``: x (B, T) int64,
            r (B,) bool, True where the row is an old-domain row.
        """
        raise NotImplementedError("ex56: ReplayStream.next")

    def state_dict(self) -> dict:
        """``{"position": int, "new": new.state_dict(), "old": old.state_dict()}``, a
        copy."""
        raise NotImplementedError("ex56: ReplayStream.state_dict")

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict``: the next batch is the one the saved stream
        would draw. Copies; ``state`` is not modified."""
        raise NotImplementedError("ex56: ReplayStream.load_state_dict")


def predict_replay_tokens(updates: int, batch: int, seq: int, replay: int,
                          period: int) -> int:
    """Predict: the old-domain tokens a ``ReplayStream`` has put into the first
    ``updates`` batches (each of ``batch`` rows of ``seq`` tokens, replay/period mix).

    The check measures it: it draws ``updates`` batches from a reference replay mix
    and counts the tokens that came from the old text. Exact (a count).

    Returns:
        The count, a Python int.
    """
    raise NotImplementedError("ex56: predict_replay_tokens")
