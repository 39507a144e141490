"""The full training state of a ``continual_pretrain.Trainer``: capture, restore, save, load.

A run resumed from a saved state continues bit for bit (CPU) where the uninterrupted run goes only if
the saved state holds everything the next update depends on: the weights (``model.safetensors``, tied
weights once, as ``save_pretrained`` stores them); AdamW's step and moments (``optimizer.pt``); the
update clock of Part 02 · 12 (applied and skipped updates); the GradScaler; the RNG states (``rng.pt``:
the data stream's generator, and torch's, Python's and NumPy's global ones, which nothing in this loop
draws from but dropout or a shuffling sampler would); the data position; the identity of the run
(workload, model config, training config, data) and of its record (``FIELDS``).

``save_training_state`` writes a saved state into a temporary directory renamed into place only when
complete, then points the ``latest`` file (replaced atomically) at it: a save killed at any point leaves
the previous saved state and ``latest`` as they were (nothing is fsynced: after a power loss the sha256
in the manifest tells a damaged file). ``load_training_state`` checks the manifest field by field, the
files' sizes and sha256, the weights' names, shapes and dtypes and the optimizer state's layout against
the live trainer *before* it changes anything; a mismatch is one ``TrainingStateError`` line and nothing
is loaded. ``config.json`` makes a saved state a Transformers model directory (``from_pretrained``).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from bp_mech.continual_pretrain import text_sha256

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
    """A saved state that cannot be resumed from; the one-line message names the path and the field."""


# --- in memory --------------------------------------------------------------------------

def rng_states(device) -> dict:
    """torch's CPU (and, on CUDA, every device's) generator, Python's and NumPy's, as tensors and lists."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out = dict(torch=torch.get_rng_state(), python=random.getstate(),
               numpy=[name, keys.tolist(), pos, has_gauss, gauss])
    if torch.device(device).type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"].clone())
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, g = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def clock_state(clock) -> dict:
    """The update clock's state (``scheduler.UpdateClock`` has no ``state_dict``): applied and skipped updates."""
    return dict(updates=clock.updates, skipped=clock.skipped)


def set_clock_state(clock, state: dict) -> None:
    clock.updates, clock.skipped = state["updates"], state["skipped"]


def capture_state(trainer) -> dict:
    """Everything the trainer's next update depends on, as copies: training on afterwards changes
    nothing in the returned dict (``state_dict()`` alone returns the live tensors)."""
    return copy.deepcopy(dict(
        model=trainer.model.state_dict(), optimizer=trainer.optimizer.state_dict(),
        scaler=trainer.scaler.state_dict(), clock=clock_state(trainer.clock),
        data=trainer.data.state_dict(), rng=rng_states(trainer.device)))


def restore_state(trainer, state: dict, *, copy_state: bool = True) -> None:
    """Put a ``capture_state`` dict back into a trainer built the same way. It copies first (AdamW's
    ``load_state_dict`` keeps the tensors it is given, and training on would change them in ``state``),
    unless the caller hands over a dict nobody else holds (``copy_state=False``). The optimizer's param
    groups carry the LR the clock set last."""
    if copy_state:
        state = copy.deepcopy(state)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scaler.load_state_dict(state["scaler"])
    set_clock_state(trainer.clock, state["clock"])
    trainer.data.load_state_dict(state["data"])
    set_rng_states(state["rng"])


# --- identity -----------------------------------------------------------------------------

MODEL_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                     "tie_word_embeddings")


def model_config_identity(config) -> dict:
    return {k: getattr(config, k, None) for k in MODEL_CONFIG_KEYS}


def identity(workload: dict, train_config, ids: torch.Tensor, batch: int, seq: int, model_config=None) -> dict:
    """The sections of ``IDENTITY``: what a saved state must share with the run that resumes it.
    ``workload`` is the record's workload group; ``model_config`` a config object (None: not compared)."""
    return dict(workload=workload, train_config=dataclasses.asdict(train_config),
                data=dict(text_sha256=text_sha256(ids), text_tokens=len(ids), batch=batch, seq=seq),
                model_config=None if model_config is None else model_config_identity(model_config))


def trainer_identity(trainer, workload: dict) -> dict:
    return identity(workload, trainer.cfg, trainer.data.ids, trainer.data.batch, trainer.data.seq, trainer.model.config)


def tied_names(state: dict) -> dict[str, str]:
    """Every name of a state dict -> the first name of the same tensor (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` under tied embeddings)."""
    first: dict[tuple, str] = {}
    return {name: first.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), name)
            for name, t in state.items()}


def unique_tensors(state: dict) -> dict:
    """A state dict without the second name of a tied tensor, as safetensors (and ``save_pretrained``) store it."""
    return {name: state[name] for name, kept in tied_names(state).items() if name == kept}


# --- on disk -------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def save_training_state(trainer, root, workload: dict, record: dict) -> Path:
    """Write the trainer's state to ``root/step-NNNNNN`` (a free name) atomically and point
    ``root/latest`` at it. ``workload``: the record's workload group; ``record``: the record's identity."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name, n = f"step-{trainer.clock.updates:06d}", 1
    while (root / name).exists():
        name, n = f"step-{trainer.clock.updates:06d}-{n}", n + 1
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
        weights = {k: v.detach().to("cpu").contiguous() for k, v in unique_tensors(trainer.model.state_dict()).items()}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        del weights
        torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(dict(data_generator=trainer.data.generator.get_state(), **rng_states(trainer.device)), tmp / "rng.pt")
        trainer.model.config.to_json_file(tmp / "config.json")
        manifest = dict(format=FORMAT, **trainer_identity(trainer, workload), record=record,
                        clock=clock_state(trainer.clock),
                        scaler=trainer.scaler.state_dict(),
                        data_position=dict(position=trainer.data.position, tokens=trainer.data.tokens),
                        files={f: dict(bytes=(tmp / f).stat().st_size, sha256=_sha256(tmp / f)) for f in FILES})
        (tmp / "state.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        os.rename(tmp, root / name)  # the saved state appears complete, or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fd, tmp_latest = tempfile.mkstemp(dir=root, prefix=".tmp-latest-")
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
    os.replace(tmp_latest, root / LATEST)
    return root / name


def resolve(path) -> Path:
    """A saved state directory, or a root whose ``latest`` names one."""
    path = Path(path)
    if (path / "state.json").exists() or not (path / LATEST).exists():
        return path
    return path / (path / LATEST).read_text().strip()


def read_manifest(path, identity: dict | None = None, semantic_id: str | None = None) -> tuple[Path, dict]:
    """Validate a saved state without touching a model: the manifest field by field, the identity
    sections given in ``identity`` (None values skipped), the record's experiment, every file's size
    and sha256. Returns (directory, manifest); raises TrainingStateError."""
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
        if _sha256(p) != info["sha256"]:
            raise TrainingStateError(f"{where}: {f} does not match its sha256 in the manifest (corrupt)")
    return path, m


def _check_layout(where: str, trainer, weights_path: Path, opt_state) -> None:
    """Weights and optimizer state against the live model, before anything is loaded."""
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


def load_training_state(trainer, path, workload: dict, semantic_id: str | None = None) -> dict:
    """Validate the saved state at ``path`` against ``trainer`` (``read_manifest`` with the trainer's
    identity, then the weights' and the optimizer state's layout) and restore it. Nothing is loaded
    unless everything checks. Returns the manifest."""
    from safetensors.torch import load_file

    path, m = read_manifest(path, trainer_identity(trainer, workload), semantic_id)
    where = f"saved state {path}"
    try:
        opt_state = torch.load(path / "optimizer.pt", map_location=trainer.device, weights_only=True)
        rng = torch.load(path / "rng.pt", weights_only=True)
    except Exception as e:  # noqa: BLE001 (unpickling errors come in many classes)
        raise TrainingStateError(f"{where}: optimizer.pt or rng.pt cannot be read: {type(e).__name__}") from None
    _check_layout(where, trainer, path / "model.safetensors", opt_state)
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
