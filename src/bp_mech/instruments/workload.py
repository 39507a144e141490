"""Workloads: which model, which text, which batch shape.

A workload is a frozen dataclass with a stable ``workload_id`` such as ``tiny-b2s128`` or
``qwen05-b2s512``. It names the model architecture, where the weights come from, the batch
shape and the seed, and it builds the model and the batches deterministically.

Two model sources:

* ``config``: a random-init Qwen2 built from ``transformers.Qwen2Config`` with a fixed seed.
  Its "commit" is the hash of the config, so two runs with the same config merge.
* ``pretrained``: a hub id (or a local directory) plus a revision, resolved to the commit
  that ``huggingface_hub`` finds; ``local_files_only`` reruns offline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

# Architectures. ``qwen05`` is Qwen2.5-0.5B exactly; ``tiny`` keeps its building blocks (GQA, SwiGLU,
# RMSNorm, tied embeddings), not its ratios, at a size that trains in seconds on 2 CPU cores: its MLP is
# 2.75 x hidden (qwen05: 4864 / 896, about 5.43 x) and 2 query heads share a KV head (qwen05: 7).
ARCHITECTURES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64,  # d_model
        intermediate_size=176,  # SwiGLU inner width, 2.75 x hidden (qwen05: about 5.43 x)
        num_hidden_layers=2,  # transformer blocks
        num_attention_heads=4,  # query heads
        num_key_value_heads=2,  # KV heads shared by 2 query heads each (GQA)
        vocab_size=384,  # 256 byte tokens + room for specials
        max_position_embeddings=1024,  # longest sequence the rotary cache covers
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "qwen05": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
}

HUB_IDS = {"qwen05": "Qwen/Qwen2.5-0.5B"}
BYTE_TOKENIZER = "bytes-v1"  # token id = UTF-8 byte value; ids >= 256 unused
PAD_ID = 0  # a byte that never occurs in the shipped text
TEXTS = ("general", "domain", "holdout")

_ID_RE = re.compile(r"^(?P<arch>[a-z0-9]+)-b(?P<b>\d+)s(?P<s>\d+)(?:-(?P<label>[a-z0-9_]+))?$")


class WorkloadError(ValueError):
    """A workload that cannot be built: unknown name, or a shape the model cannot take."""


@dataclass(frozen=True)
class Workload:
    """One fixed model + batch shape, identified by ``workload_id``."""

    arch: str  # key of ARCHITECTURES
    batch: int  # sequences per micro-batch (B)
    seq: int  # tokens per sequence (T)
    source: str = "config"  # "config" (random init) or "pretrained"
    model_id: str | None = None  # hub id or local dir for "pretrained"; None -> HUB_IDS[arch]
    revision: str = "main"  # hub revision, resolved to a commit for "pretrained"
    local_files_only: bool = False  # offline reruns of "pretrained"
    seed: int = 0  # model init and data order
    dtype: str = "float32"  # dtype of the master weights
    updates: int = 4  # optimizer updates an experiment runs by default
    label: str | None = None  # run-label suffix, e.g. "8gib" for a shrunken matrix

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise WorkloadError(f"unknown architecture {self.arch!r}; known: {', '.join(ARCHITECTURES)}")
        if self.batch < 1 or self.seq < 2:
            raise WorkloadError(f"batch must be >= 1 and seq >= 2, got b={self.batch} s={self.seq}")
        limit = ARCHITECTURES[self.arch]["max_position_embeddings"]
        if self.seq > limit:
            raise WorkloadError(f"sequence length {self.seq} exceeds {self.arch}'s max_position_embeddings {limit}")
        if self.source not in ("config", "pretrained"):
            raise WorkloadError(f"unknown model source {self.source!r}; use 'config' or 'pretrained'")

    @property
    def workload_id(self) -> str:
        base = f"{self.arch}-b{self.batch}s{self.seq}"
        return f"{base}-{self.label}" if self.label else base

    @property
    def hub_id(self) -> str:
        return self.model_id or HUB_IDS.get(self.arch, f"config:{self.arch}")

    @property
    def tokenizer_name(self) -> str:
        return self.hub_id if self.source == "pretrained" else BYTE_TOKENIZER

    def replace(self, **changes) -> "Workload":
        return dataclasses.replace(self, **changes)


def parse_workload(text: str, **overrides) -> Workload:
    """``"tiny-b2s128"`` -> Workload. Raises WorkloadError on anything else."""
    m = _ID_RE.match(text.strip())
    if not m:
        raise WorkloadError(f"cannot parse workload {text!r}; expected e.g. 'tiny-b2s128' or 'qwen05-b2s512'")
    return Workload(arch=m["arch"], batch=int(m["b"]), seq=int(m["s"]), label=m["label"], **overrides)


# --- models -------------------------------------------------------------------------

def qwen2_config(arch: str, **overrides):
    """The ``transformers.Qwen2Config`` of an architecture (eager-free: SDPA attention)."""
    from transformers import Qwen2Config

    kw = dict(ARCHITECTURES[arch], use_cache=False, attn_implementation="sdpa")
    kw.update(overrides)
    return Qwen2Config(**kw)


def config_commit(arch: str, **overrides) -> str:
    """A stable "commit" for a random-init model: sha256 of its architecture fields."""
    blob = json.dumps(dict(ARCHITECTURES[arch], **overrides), sort_keys=True)
    return "config-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def resolve_pretrained(model_id: str, revision: str = "main", local_files_only: bool = False) -> tuple[str, str]:
    """Resolve a hub id (or a local directory) to ``(path, commit)``, once per process.

    A hub id goes through ``huggingface_hub.snapshot_download``, whose snapshot folder is
    named after the commit the revision resolved to; the answer is cached per
    ``(model_id, revision, local_files_only)`` (a run asks for it for every record, model and
    tokenizer). A model that is not in the local cache while downloads are off
    (``local_files_only`` or ``HF_HUB_OFFLINE=1``), or that the hub does not have, is a
    ``WorkloadError`` naming the model id and revision. A local directory
    (``save_pretrained`` output) gets the sha256 of its config and weight files as its commit,
    cached until one of those files changes (name, size or mtime).
    """
    path = Path(model_id)
    if path.is_dir():
        files = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir()
                             if f.suffix in _LOCAL_MODEL_SUFFIXES))
        return _resolve_local(str(path), files)
    return _resolve_hub(model_id, revision, bool(local_files_only))


_LOCAL_MODEL_SUFFIXES = (".json", ".safetensors", ".bin")  # the files a local model's commit hashes


@functools.lru_cache(maxsize=None)
def _resolve_local(path: str, files: tuple) -> tuple[str, str]:
    h = hashlib.sha256()
    for name, _, _ in files:  # sorted by name
        h.update(name.encode())
        h.update((Path(path) / name).read_bytes())
    return path, "local-" + h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _resolve_hub(model_id: str, revision: str, local_files_only: bool) -> tuple[str, str]:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        snap = Path(snapshot_download(model_id, revision=revision, local_files_only=local_files_only))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise WorkloadError(
            f"pretrained model {model_id!r} revision {revision!r} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and downloads are off (local_files_only or HF_HUB_OFFLINE=1); "
            "download it first or point --model-id at a local directory") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise WorkloadError(f"pretrained model {model_id!r} revision {revision!r} not found on the hub: "
                            f"{type(e).__name__}") from None
    return str(snap), snap.name


def model_commit(w: Workload) -> str:
    if w.source == "config":
        return config_commit(w.arch)
    return resolve_pretrained(w.hub_id, w.revision, w.local_files_only)[1]


def build_model(w: Workload, device: str | torch.device = "cpu", **config_overrides):
    """Build the workload's model in train mode, float32 master weights, on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    dtype = getattr(torch, w.dtype)
    if w.source == "config":
        cfg = qwen2_config(w.arch, **config_overrides)
        dev = torch.device(device)
        on_gpu = dev.type == "cuda"  # initialise there: qwen05's random init takes seconds on the host
        with torch.random.fork_rng(devices=[dev] if on_gpu else []), (dev if on_gpu else contextlib.nullcontext()):
            torch.manual_seed(w.seed)  # (a GPU init draws from the GPU's generator: other weights, same seed)
            model = Qwen2ForCausalLM(cfg)
        model = model.to(device=device, dtype=dtype)
    else:
        path, _ = resolve_pretrained(w.hub_id, w.revision, w.local_files_only)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", local_files_only=True, **config_overrides
        ).to(device)
        model.config.use_cache = False
    model.train()
    return model


def param_count(arch: str) -> int:
    """Parameters of a Qwen2 architecture (q/k/v biases, tied embeddings), from its config fields."""
    a = ARCHITECTURES[arch]
    C, inter, L, V = a["hidden_size"], a["intermediate_size"], a["num_hidden_layers"], a["vocab_size"]
    kv = C // a["num_attention_heads"] * a["num_key_value_heads"]
    attn = C * C + C + 2 * (C * kv + kv) + C * C  # q (+bias), k, v (+bias), o
    return V * C + L * (attn + 3 * C * inter + 2 * C) + C


# --- text and batches ---------------------------------------------------------------

def load_text(name: str = "general") -> str:
    if name not in TEXTS:
        raise WorkloadError(f"unknown text {name!r}; shipped texts: {', '.join(TEXTS)}")
    return resources.files("bp_mech").joinpath(f"data/{name}.txt").read_text(encoding="utf-8")


def tokenize(text: str, w: Workload | None = None) -> torch.Tensor:
    """Deterministic token ids, shape (N,). Byte-level for config models; the model's own
    tokenizer (offline) for pretrained ones."""
    if w is not None and w.source == "pretrained":
        from transformers import AutoTokenizer

        path, _ = resolve_pretrained(w.hub_id, w.revision, w.local_files_only)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def make_batches(w: Workload, n: int, text: str = "general", device="cpu") -> list[dict[str, torch.Tensor]]:
    """``n`` batches of ``input_ids``/``labels`` (B, T), cut from the text in a fixed order.

    The text is repeated as needed; batch ``i`` starts at a seed-dependent offset so that
    consecutive batches differ. Labels equal the inputs (the model shifts them).
    """
    ids = tokenize(load_text(text), w)
    need = w.batch * w.seq
    g = torch.Generator().manual_seed(w.seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(ids), (w.batch,), generator=g)
        rows = [ids.roll(-int(s))[: w.seq] if len(ids) >= w.seq else ids.repeat(w.seq // len(ids) + 1)[: w.seq]
                for s in starts]
        x = torch.stack(rows).to(device)  # (B, T)
        assert x.numel() == need
        out.append({"input_ids": x, "labels": x.clone()})
    return out


def workload_fields(w: Workload) -> dict:
    """The workload group of a result record. ``updates`` is left null: only an experiment knows
    how many optimizer steps it ran, and it passes that count itself."""
    return dict(
        workload_id=w.workload_id,
        model_id=w.hub_id,
        model_commit=model_commit(w),
        model_source=w.source,
        tokenizer=w.tokenizer_name,
        input_shape=[w.batch, w.seq],
        effective_batch=w.batch,
        updates=None,
        dtype=w.dtype,
        seed=w.seed,
    )
