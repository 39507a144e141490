"""What ``bp-mech plan`` takes: a Transformers config (read offline), a batch shape, a memory budget.

Bad input is a ``PlanError`` (one line, exit 2): an unreadable config, an architecture Transformers has
no class for, a shape the config cannot take, a budget that is not a size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


from bp_mech.instruments.workload import WorkloadError

# model types validated against tracked-CPU peaks at tiny size (tests/planner/test_plan.py)
FAMILIES = ("qwen2", "llama", "mistral", "phi3", "gemma", "gpt_neox", "bloom", "mixtral", "gpt2", "opt", "falcon")
GiB = 2**30
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanError(WorkloadError):
    """A plan that cannot be made: unknown architecture, a shape the config cannot take, a bad budget."""


def parse_size(text: str) -> int:
    """``"8GiB"`` -> 8589934592; decimal (GB) and binary (GiB) units, or plain bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS:
        raise PlanError(f"cannot read the budget {text!r}; write e.g. 8GiB, 80GB or 512MiB")
    size = int(float(m[1]) * _UNITS[m[2].lower()])
    if size <= 0:
        raise PlanError(f"the budget must be more than 0 bytes, got {text!r}")
    return size


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def load_config(path) -> object:
    """A Transformers config from a ``config.json`` (or a directory holding one), offline."""
    from transformers import AutoConfig

    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read config {p}: {e}") from None
    if not isinstance(d, dict):
        raise PlanError(f"cannot read config {p}: a config.json holds one JSON object, this one a {type(d).__name__}")
    kind = d.pop("model_type", None)
    from transformers import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        raise PlanError(f"unknown architecture {kind!r} in {p}: Transformers {transformers_version()} has no config "
                        f"class for it; validated families: {', '.join(FAMILIES)}")
    try:
        return AutoConfig.for_model(kind, **d)
    except Exception as e:  # noqa: BLE001 (Transformers' config classes raise many kinds; all mean "cannot read it")
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise PlanError(f"cannot read the {kind!r} config {p}: {type(e).__name__}: {first}") from None


def check_shape(config, batch: int, seq: int) -> None:
    """Refuse what the config cannot take: batch < 1, seq < 2, seq beyond max_position_embeddings."""
    if batch < 1 or seq < 2:
        raise PlanError(f"batch must be >= 1 and seq >= 2, got --batch {batch} --seq {seq}")
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and 0 < limit < seq:  # (XLNet's -1: no limit)
        raise PlanError(f"--seq {seq} exceeds the config's max_position_embeddings {limit} ({config.model_type})")
