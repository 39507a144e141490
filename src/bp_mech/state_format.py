"""The on-disk format of a saved training state, and the checks made before anything is loaded.

A saved state is a directory of ``FILES`` (the weights once per tensor: ``unique_tensors``) and the manifest
``state.json`` (``FIELDS``: the run's identity, ``bp_mech.state_identity``; every file's size and sha256,
``file_sha256``); a root names its newest complete saved state in ``latest`` (``resolve``).
``read_manifest`` validates one without touching a model, ``check_layout`` its weights and optimizer state
against the live ones. Saving and loading are ``bp_mech.training_state``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

FORMAT = "bp-mech-training-state/1"
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "config.json")
LATEST = "latest"  # the file in a saved state root that names the newest complete saved state
IDENTITY = ("workload", "model_config", "train_config", "data")  # sections that must equal the run's
FIELDS = {  # every field of state.json, and what it holds
    "format": "the layout version, " + FORMAT,
    "workload": "workload id, model id and commit, source, tokenizer, dtype, seed",
    "model_config": "the architecture fields of the model config",
    "train_config": "the training phase's config (LR schedule, clipping, scaler, data seed)",
    "data": "the training text's sha256 and token count, batch and sequence length",
    "record": "the experiment, run label and candidate the saved state was made for",
    "clock": "the update clock: applied and skipped updates",
    "scaler": "the GradScaler's state (scale, growth tracker)",
    "data_position": "batches drawn and tokens seen",
    "files": "size and sha256 of the weights (safetensors), optimizer state, RNG states, model config",
}


class TrainingStateError(ValueError):
    """A saved state that cannot be resumed from; the one-line message names the path and the field.

    Args:
        message: ``"saved state <path>: <what is wrong>"``, naming the field (``'clock'``,
            ``'workload.seed'``) or the file where one is at fault.

    Example:
        >>> err = TrainingStateError("saved state /tmp/s: field 'clock' is missing")
        >>> isinstance(err, ValueError), str(err)
        (True, "saved state /tmp/s: field 'clock' is missing")
    """


def tied_names(state: dict) -> dict[str, str]:
    """Every name of a state dict -> the first name of the same tensor.

    ``lm_head.weight`` -> ``model.embed_tokens.weight`` under tied embeddings: tensors are the same when
    they share storage, offset and shape.

    Args:
        state: a state dict, name -> tensor (the live ``model.state_dict()``: copies share nothing).

    Returns:
        ``{name: first name of its tensor}``, in ``state``'s order; an untied name maps to itself.

    Example:
        >>> w = torch.zeros(4, 2)
        >>> list(tied_names({"model.embed_tokens.weight": w, "lm_head.weight": w, "norm": torch.ones(2)}).values())
        ['model.embed_tokens.weight', 'model.embed_tokens.weight', 'norm']
    """
    first: dict[tuple, str] = {}
    return {name: first.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), name)
            for name, t in state.items()}


def unique_tensors(state: dict) -> dict:
    """A state dict without the second name of a tied tensor, as safetensors (and ``save_pretrained``) store it.

    Args:
        state: a state dict, name -> tensor.

    Returns:
        The entries of ``state`` whose name is the first of its tensor (``tied_names``), same tensors.

    Example:
        >>> w = torch.zeros(4, 2)
        >>> list(unique_tensors({"model.embed_tokens.weight": w, "lm_head.weight": w, "norm": torch.ones(2)}))
        ['model.embed_tokens.weight', 'norm']
    """
    return {name: state[name] for name, kept in tied_names(state).items() if name == kept}


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 16 MiB chunks: what the manifest keeps of every file of ``FILES``.

    Args:
        path: the file.

    Returns:
        The hex digest, 64 characters.

    Example:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "x"
        >>> _ = f.write_bytes(b"abc")
        >>> file_sha256(f)[:16]
        'ba7816bf8f01cfea'
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve(path) -> Path:
    """A saved state directory, or a root whose ``latest`` names one.

    A directory with a ``state.json``, or without ``latest``, is returned as it is (``read_manifest`` checks).

    Args:
        path: a saved state directory, or a root that ``save_training_state`` wrote into.

    Returns:
        ``path`` as a ``Path``, or ``path / <the name in latest>``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root:
        ...     _ = (Path(root) / LATEST).write_text("step-000003")
        ...     print(resolve(root).relative_to(root))
        step-000003
    """
    path = Path(path)
    if (path / "state.json").exists() or not (path / LATEST).exists():
        return path
    return path / (path / LATEST).read_text().strip()


def read_manifest(path, identity: dict | None = None, semantic_id: str | None = None) -> tuple[Path, dict]:
    """Validate a saved state without touching a model.

    The manifest field by field, the identity sections given in ``identity`` (None values skipped),
    the record's experiment, every file's size and sha256.

    Args:
        path: a saved state directory, or a root whose ``latest`` names one (``resolve``).
        identity: section -> what the run has (``trainer_identity``); every key of either side must be
            equal. None (or a None section): not compared.
        semantic_id: the ``record.semantic_id`` the saved state must have; None: not compared.

    Returns:
        (directory, manifest): the saved state directory and its ``state.json`` as a dict (``FIELDS``).

    Raises:
        TrainingStateError: no or invalid ``state.json``, a missing field, another format, identity or
            experiment; a malformed clock or data position; a missing, truncated or corrupt file.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as empty:
        ...     try:
        ...         read_manifest(empty)
        ...     except TrainingStateError as e:
        ...         print(str(e).split(": ", 1)[1])
        no state.json (not a saved state directory, or a save that never finished)
    """
    path = resolve(path)
    where = f"saved state {path}"
    if not (path / "state.json").is_file():
        raise TrainingStateError(f"{where}: no state.json (not a saved state directory, or a save that never finished)")
    try:
        m = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrainingStateError(f"{where}: state.json is not valid JSON (truncated or corrupt?): {e}") from None
    if not isinstance(m, dict):
        raise TrainingStateError(f"{where}: state.json must hold an object")
    for field in FIELDS:
        if field not in m:
            raise TrainingStateError(f"{where}: field '{field}' is missing ({FIELDS[field]})")
    if m["format"] != FORMAT:
        raise TrainingStateError(f"{where}: field 'format' is {m['format']!r}, expected {FORMAT!r}")
    for section, want in (identity or {}).items():
        if want is None:
            continue
        have = m[section]
        for key in dict.fromkeys([*want, *(have if isinstance(have, dict) else {})]):
            if not isinstance(have, dict) or have.get(key) != want.get(key):
                got = have.get(key) if isinstance(have, dict) else have
                raise TrainingStateError(f"{where}: field '{section}.{key}' is {got!r} in the saved state but "
                                      f"{want.get(key)!r} in this run (a saved state of another {section.replace('_', ' ')})")
    if semantic_id is not None and (m["record"] or {}).get("semantic_id") != semantic_id:
        raise TrainingStateError(f"{where}: field 'record.semantic_id' is {(m['record'] or {}).get('semantic_id')!r}, "
                              f"this run is {semantic_id!r}")
    clock = m["clock"]
    if not (isinstance(clock, dict) and all(isinstance(clock.get(k), int) and clock[k] >= 0 for k in ("updates", "skipped"))):
        raise TrainingStateError(f"{where}: field 'clock' must hold non-negative integers 'updates' and 'skipped', got {clock!r}")
    if not isinstance(m["data_position"], dict) or not isinstance(m["data_position"].get("position"), int):
        raise TrainingStateError(f"{where}: field 'data_position.position' must be an integer")
    for f in FILES:
        info, p = m["files"].get(f) if isinstance(m["files"], dict) else None, path / f
        if not isinstance(info, dict) or "bytes" not in info or "sha256" not in info:
            raise TrainingStateError(f"{where}: field 'files.{f}' is missing")
        if not p.is_file():
            raise TrainingStateError(f"{where}: {f} is missing")
        if p.stat().st_size != info["bytes"]:
            raise TrainingStateError(f"{where}: {f} is {p.stat().st_size} bytes, the manifest says {info['bytes']} "
                                  "(truncated or replaced)")
        if file_sha256(p) != info["sha256"]:
            raise TrainingStateError(f"{where}: {f} does not match its sha256 in the manifest (corrupt)")
    return path, m


def check_layout(where: str, trainer, weights_path: Path, opt_state) -> None:
    """Saved weights and optimizer state against the live model and optimizer, before anything is loaded.

    Args:
        where: the message's prefix, ``"saved state <path>"``.
        trainer: the ``bench.trainer.Trainer`` to restore into.
        weights_path: the saved ``model.safetensors``.
        opt_state: the saved optimizer ``state_dict()``.

    Returns:
        None; it only checks.

    Raises:
        TrainingStateError: a weight missing, unknown or of another shape or dtype, or optimizer state of
            another parameter layout.

    Example:
        >>> from types import SimpleNamespace
        >>> trainer = SimpleNamespace(model=torch.nn.Linear(2, 1))
        >>> try:
        ...     check_layout("saved state /x", trainer, Path("/nonexistent.safetensors"), {})
        ... except TrainingStateError as e:
        ...     print(str(e).split(":")[1].strip())
        model.safetensors cannot be read
    """
    from safetensors import safe_open

    want = unique_tensors(trainer.model.state_dict())
    try:
        with safe_open(weights_path, "pt") as f:
            have = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
        raise TrainingStateError(f"{where}: model.safetensors cannot be read: {e}") from None
    for k in sorted(set(want) ^ set(have)):
        raise TrainingStateError(f"{where}: weight {k!r} is {'missing from' if k in want else 'unknown to'} this model")
    for k, t in want.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if have[k][0] != tuple(t.shape) or _ST_DTYPES.get(have[k][1]) != dtype:
            raise TrainingStateError(f"{where}: weight {k!r} is {have[k][1]} {list(have[k][0])} in the saved state, "
                                  f"{dtype} {list(t.shape)} in this model")
    groups = opt_state.get("param_groups") if isinstance(opt_state, dict) else None
    live = trainer.optimizer.param_groups
    if not isinstance(groups, list) or [len(g["params"]) for g in groups] != [len(g["params"]) for g in live]:
        raise TrainingStateError(f"{where}: optimizer state of another parameter layout: parameters per group "
                              f"{[len(g['params']) for g in groups or []]}, this optimizer has "
                              f"{[len(g['params']) for g in live]}")
    params = [p for g in live for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    for i, p in zip(ids, params):
        for key, t in opt_state["state"].get(i, {}).items():
            if torch.is_tensor(t) and t.dim() > 0 and tuple(t.shape) != tuple(p.shape):
                raise TrainingStateError(f"{where}: optimizer state of another parameter layout: parameter {i} is "
                                      f"{list(p.shape)} here, its {key} {list(t.shape)} in the saved state")


_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
