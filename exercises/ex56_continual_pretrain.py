"""Exercises for Part 02 · 56 — continual pretraining: the per-token holdout loss, and a training state
that resumes bit for bit.

The trainer the state exercises work on is the package's
``bp_mech.continual_pretrain.Trainer``. Its attributes:

* ``model``: a ``transformers`` causal LM (tied embeddings: ``lm_head.weight`` is
  ``model.embed_tokens.weight``);
* ``optimizer``: ``torch.optim.AdamW`` (its state holds ``step``, ``exp_avg``,
  ``exp_avg_sq`` per parameter);
* ``scaler``: a ``torch.amp.GradScaler`` (``state_dict()`` / ``load_state_dict()``);
* ``clock``: a ``bp_mech.scheduler.UpdateClock``, whose plain attributes ``updates``
  (applied updates) and ``skipped`` (skipped optimizer calls) set the learning rate;
* ``data``: a ``bp_mech.continual_pretrain.TextStream``: ``position`` (batches drawn so
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
        L as a Python float (accumulate in float64).
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
        trainer: a ``bp_mech.continual_pretrain.Trainer`` (see the module docstring).

    Returns:
        A dict that ``restore_state`` can put back.
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
        trainer: the fresh ``bp_mech.continual_pretrain.Trainer``.
        state: what ``capture_state`` returned.
    """
    raise NotImplementedError("ex56: restore_state")
