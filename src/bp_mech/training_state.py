"""The full training state of a trainer (``bench.trainer.Trainer``): capture, restore, save, load.

A run resumed from a saved state continues bit for bit (CPU) where the uninterrupted run
goes only if the saved state holds everything the next update depends on: the weights
(``model.safetensors``, tied weights once, as ``save_pretrained`` stores them); AdamW's
step and moments (``optimizer.pt``); the update clock of Part 02 · 12 (applied and
skipped updates); the GradScaler; the RNG states (``rng.pt``: the data stream's
generator, and torch's, Python's and NumPy's global ones, which nothing in this loop
draws from but dropout or a shuffling sampler would); the data position; the identity of
the run (workload, model config, training config, data) and of its record (``FIELDS``).

``save_training_state`` writes a saved state into a temporary directory renamed into
place only when complete, then points the ``latest`` file (replaced atomically) at it: a
save killed at any point leaves the previous saved state and ``latest`` as they were
(nothing is fsynced: after a power loss the sha256 in the manifest tells a damaged
file). ``load_training_state`` checks the manifest field by field, the files' sizes and
sha256, the weights' names, shapes and dtypes and the optimizer state's layout against
the live trainer *before* it changes anything; a mismatch is one ``TrainingStateError``
line and nothing is loaded. ``config.json`` makes a saved state a Transformers model
directory (``from_pretrained``). The format and its checks are ``bp_mech.state_format``, the
run's identity ``bp_mech.state_identity``, the RNG states ``bp_mech.rng_state``.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from bp_mech.rng_state import rng_states, set_rng_states
from bp_mech.state_format import (FILES, FORMAT, LATEST, TrainingStateError, check_layout, file_sha256,
                                  read_manifest, tied_names, unique_tensors)
from bp_mech.state_identity import trainer_identity


# --- in memory --------------------------------------------------------------------------

def clock_state(clock) -> dict:
    """The update clock's counts, applied and skipped updates (what
    ``UpdateClock.state_dict`` holds).

    Args:
        clock: a ``scheduler.UpdateClock``; its learning rate follows from ``updates``.

    Returns:
        ``{"updates": int, "skipped": int}``.

    Example:
        >>> from bp_mech.scheduler import UpdateClock, WSDConfig
        >>> clock = UpdateClock(WSDConfig())
        >>> _ = clock.step(True), clock.step(False)  # one applied update, one skipped
        >>> clock_state(clock)
        {'updates': 1, 'skipped': 1}
    """
    return dict(updates=clock.updates, skipped=clock.skipped)


def set_clock_state(clock, state: dict) -> None:
    """Set the update clock's counts from a ``clock_state`` dict; the LR in the optimizer is not rewritten.

    Args:
        clock: the ``scheduler.UpdateClock`` to set, in place.
        state: ``{"updates": int, "skipped": int}``, as ``clock_state`` returns it.

    Returns:
        None.

    Example:
        >>> from bp_mech.scheduler import UpdateClock, WSDConfig
        >>> clock = UpdateClock(WSDConfig())
        >>> set_clock_state(clock, {"updates": 5, "skipped": 2})
        >>> clock.updates, clock.skipped, clock.calls
        (5, 2, 7)
    """
    clock.updates, clock.skipped = state["updates"], state["skipped"]


def capture_state(trainer) -> dict:
    """Everything the trainer's next update depends on, as copies.

    Training on afterwards changes nothing in the returned dict (``state_dict()``
    returns the live tensors).

    Args:
        trainer: a ``bench.trainer.Trainer`` (``phase_trainer``'s).

    Returns:
        A deep copy of ``{"model", "optimizer", "scaler"}`` (their ``state_dict()``),
        ``"clock"`` (``clock_state``), ``"data"`` (the ``TextStream``'s
        ``state_dict()``) and ``"rng"`` (``rng_states``).

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> from bp_mech.bench.trainer import phase_trainer
        >>> from bp_mech.continual_data import TextStream
        >>> from bp_mech.continual_pretrain import TrainConfig, train
        >>> t = phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
        ...                   TextStream(torch.arange(64), 1, 8, 0))
        >>> state = capture_state(t); _ = train(t, 2)
        >>> state["clock"], t.clock.updates
        ({'updates': 0, 'skipped': 0}, 2)
    """
    return copy.deepcopy(dict(
        model=trainer.model.state_dict(), optimizer=trainer.optimizer.state_dict(),
        scaler=trainer.scaler.state_dict(), clock=clock_state(trainer.clock),
        data=trainer.data.state_dict(), rng=rng_states(trainer.device)))


def restore_state(trainer, state: dict, *, copy_state: bool = True) -> None:
    """Put a ``capture_state`` dict back into a trainer built the same way.

    It copies first (AdamW's ``load_state_dict`` keeps the tensors it is given, and
    training on would change them in ``state``), unless the caller hands over a dict
    nobody else holds (``copy_state=False``). The optimizer's param groups carry the LR
    the clock set last. The global RNGs are set too.

    Args:
        trainer: a ``bench.trainer.Trainer`` (``phase_trainer``'s) with the same
            model, optimizer and data stream layout.
        state: a ``capture_state`` dict.
        copy_state: False: use ``state``'s tensors as they are (the caller hands
            ``state`` over).

    Returns:
        None.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> from bp_mech.bench.trainer import phase_trainer
        >>> from bp_mech.continual_data import TextStream
        >>> from bp_mech.continual_pretrain import TrainConfig, train
        >>> t = phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
        ...                   TextStream(torch.arange(64), 1, 8, 0))
        >>> state = capture_state(t); first = [row.loss for row in train(t, 2)]
        >>> restore_state(t, state)
        >>> [row.loss for row in train(t, 2)] == first
        True
    """
    if copy_state:
        state = copy.deepcopy(state)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scaler.load_state_dict(state["scaler"])
    set_clock_state(trainer.clock, state["clock"])
    trainer.data.load_state_dict(state["data"])
    set_rng_states(state["rng"])


# --- on disk -------------------------------------------------------------------------------

def save_training_state(trainer, root, workload: dict, record: dict) -> Path:
    """Write the trainer's state to ``root/step-NNNNNN`` atomically, then ``latest``.

    ``root/step-NNNNNN`` is a free name; ``root/latest`` names it afterwards.

    NNNNNN is the clock's applied updates (a name taken gets ``-1``, ``-2``, ...).
    ``FILES`` and ``state.json`` are written into ``root/.tmp-<name>-*``, renamed into
    place when complete; an error removes it (and propagates).

    Args:
        trainer: the ``bench.trainer.Trainer`` to save.
        root: the directory of the saved states; created if missing.
        workload: the record's workload group (``workload.workload_fields``).
        record: the record's identity (``semantic_id``, run label, candidate), kept as
            the manifest's ``record``.

    Returns:
        The new saved state directory, ``root/step-NNNNNN`` (or ``root/step-NNNNNN-k``).

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> from bp_mech.bench.trainer import phase_trainer
        >>> from bp_mech.continual_data import TextStream
        >>> from bp_mech.continual_pretrain import TrainConfig
        >>> t = phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
        ...                   TextStream(torch.arange(64), 1, 8, 0))
        >>> with tempfile.TemporaryDirectory() as root:
        ...     path = save_training_state(t, root, {"workload_id": "tiny-b1s8"},
        ...                                {"semantic_id": "X"})
        ...     files = sorted(p.name for p in path.iterdir())
        ...     latest = (Path(root) / LATEST).read_text().strip()
        >>> path.name, latest
        ('step-000000', 'step-000000')
        >>> files
        ['config.json', 'model.safetensors', 'optimizer.pt', 'rng.pt', 'state.json']
    """
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name, n = f"step-{trainer.clock.updates:06d}", 1
    while (root / name).exists():
        name, n = f"step-{trainer.clock.updates:06d}-{n}", n + 1
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
        weights = {k: v.detach().to("cpu").contiguous()
                   for k, v in unique_tensors(trainer.model.state_dict()).items()}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        del weights
        torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(dict(data_generator=trainer.data.generator.get_state(),
                        **rng_states(trainer.device)), tmp / "rng.pt")
        trainer.model.config.to_json_file(tmp / "config.json")
        manifest = dict(format=FORMAT, **trainer_identity(trainer, workload),
                        record=record, clock=clock_state(trainer.clock),
                        scaler=trainer.scaler.state_dict(),
                        data_position=dict(position=trainer.data.position,
                                           tokens=trainer.data.tokens),
                        files={f: dict(bytes=(tmp / f).stat().st_size,
                                       sha256=file_sha256(tmp / f)) for f in FILES})
        (tmp / "state.json").write_text(json.dumps(manifest, indent=1) + "\n",
                                        encoding="utf-8")
        os.rename(tmp, root / name)  # the saved state appears complete, or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fd, tmp_latest = tempfile.mkstemp(dir=root, prefix=".tmp-latest-")
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
    os.replace(tmp_latest, root / LATEST)
    return root / name


def load_training_state(trainer, path, workload: dict, semantic_id: str | None = None) -> dict:
    """Validate the saved state at ``path`` against ``trainer`` and restore it.

    ``read_manifest`` with the trainer's identity, then the weights' and the optimizer
    state's layout, the RNG states and the scaler, then ``restore_state``. Nothing is
    loaded unless everything checks.

    Args:
        trainer: a ``bench.trainer.Trainer`` (``phase_trainer``'s) built as the
            saved one was (its weights may differ).
        path: a saved state directory, or a root whose ``latest`` names one.
        workload: the run's workload group, compared with the manifest's.
        semantic_id: the experiment the saved state must have been made for; None: not
            compared.

    Returns:
        The manifest (``state.json`` as a dict, ``FIELDS``).

    Raises:
        TrainingStateError: as ``read_manifest``; an unreadable ``optimizer.pt`` or
            ``rng.pt``; weights or optimizer state of another layout; missing RNG
            states; another scaler. The trainer is unchanged.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> from bp_mech.bench.trainer import phase_trainer
        >>> from bp_mech.continual_data import TextStream
        >>> from bp_mech.continual_pretrain import TrainConfig, train
        >>> t = phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
        ...                   TextStream(torch.arange(64), 1, 8, 0))
        >>> with tempfile.TemporaryDirectory() as root:
        ...     _ = save_training_state(t, root, {}, {"semantic_id": "X"}); _ = train(t, 2)
        ...     print(load_training_state(t, root, {}, "X")["clock"], t.clock.updates)
        {'updates': 0, 'skipped': 0} 0
    """
    from safetensors.torch import load_file

    path, m = read_manifest(path, trainer_identity(trainer, workload), semantic_id)
    where = f"saved state {path}"
    try:
        opt_state = torch.load(path / "optimizer.pt", map_location=trainer.device, weights_only=True)
        rng = torch.load(path / "rng.pt", weights_only=True)
    except Exception as e:  # noqa: BLE001 (unpickling errors come in many classes)
        raise TrainingStateError(f"{where}: optimizer.pt or rng.pt cannot be read: {type(e).__name__}") from None
    check_layout(where, trainer, path / "model.safetensors", opt_state)
    missing = {"torch", "python", "numpy", "data_generator"} - set(rng)
    if missing:
        raise TrainingStateError(f"{where}: rng.pt lacks the RNG state(s) {sorted(missing)}")
    if set(m["scaler"]) != set(trainer.scaler.state_dict()):
        raise TrainingStateError(f"{where}: field 'scaler' has keys {sorted(m['scaler'])}, this GradScaler "
                              f"{sorted(trainer.scaler.state_dict())} (enabled in one, disabled in the other?)")
    weights = load_file(path / "model.safetensors", device=str(trainer.device))
    full = {name: weights[kept] for name, kept in tied_names(trainer.model.state_dict()).items()}
    restore_state(trainer, copy_state=False, state=dict(
        model=full, optimizer=opt_state, scaler=m["scaler"], clock=m["clock"],
        data=dict(position=m["data_position"]["position"], generator=rng["data_generator"]),
        rng={k: v for k, v in rng.items() if k != "data_generator"}))
    return m
