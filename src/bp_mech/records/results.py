"""The result record: one candidate of one experiment run, saved as one JSON file.

Every field of DESIGN.md is present in every record (``None`` where it does not apply).
Records are written atomically (temp file + rename), validated against the JSON Schema that
ships with the package (``records/schema/record.schema.json``) on save and on load, and refused in a
comparison when their ``model_commit`` or ``workload_id`` differ. A record whose
``code_hash`` no longer matches the code that determines its numbers is *stale*
(``bp_mech.records.provenance``); chapters show it so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from bp_mech.records.decision import VERDICTS

EVIDENCE_LEVELS = ("cpu-mechanism", "gpu-measured", "estimated", "theoretical")
MEMORY_SOURCES = ("cuda-allocator", "tracked-cpu", "fake-tensor", "formula")
DECISIONS = VERDICTS  # a record's ``decision``: a rule's ``Decision.verdict`` (records.decision), or null


class RecordError(ValueError):
    """A record that cannot be used; the message names the file and the field."""


@dataclass
class Record:
    # identity
    semantic_id: str  # registry ID, e.g. TRAIN-LOCAL-BACKWARD
    workload_id: str  # e.g. tiny-b2s128
    run_label: str  # e.g. cpu-default; a shrunken matrix gets its own label
    page: str  # e.g. "Part 02 · 09"
    candidate: str  # which arm of the fixed comparison
    strategy: str | None = None  # the memory strategy its training steps ran (bench.strategy's name), None: none
    # workload
    model_id: str | None = None
    model_commit: str | None = None
    model_source: str | None = None  # config | pretrained
    tokenizer: str | None = None
    input_shape: list | None = None
    effective_batch: int | None = None
    updates: int | None = None  # optimizer steps that applied an update, over the arm's runs (metrics.updates_by_run)
    dtype: str | None = None
    seed: int | None = None
    # environment
    profile_id: str | None = None
    python: str | None = None
    torch: str | None = None
    transformers: str | None = None
    cuda: str | None = None
    device_name: str | None = None
    device_memory: int | None = None  # bytes
    numerics: dict | None = None  # matmul precision, TF32, cuDNN, SDPA kernel: environment.numerics
    # correctness
    output_error: float | None = None
    grad_error: float | None = None
    all_finite: bool | None = None
    skipped_updates: int | None = None  # optimizer steps whose update the fp16 scaler skipped
    # resources and performance
    peak_allocated: int | None = None  # bytes
    peak_reserved: int | None = None  # bytes
    step_median_s: float | None = None  # by ``step_clock``: the thread's CPU time on the CPU, wall time on CUDA
    step_p95_s: float | None = None
    step_clock: str | None = None  # "thread_time" | "wall" (bench.timing.CLOCKS)
    wall_median_s: float | None = None  # the same steps by the wall clock
    wall_p95_s: float | None = None
    warmup_excluded: int | None = None
    threads: int | None = None  # CPU intra-op threads inside the timed steps (None: CUDA, or not timed)
    timing_noise: str | None = None  # why the time ratio is noise and decides nothing (None: usable)
    transfer_bytes: dict | None = None  # {"d2h": int, "h2d": int}
    recompute_count: int | None = None
    memory_source: str | None = None
    # conclusion
    failure: str | None = None
    evidence_level: str = "cpu-mechanism"
    decision: str | None = None
    next_step: str | None = None
    # experiment-specific measurements (per-op errors, boundaries, traces, ...)
    metrics: dict = field(default_factory=dict)
    # provenance
    created_at: str | None = None
    bp_mech_version: str | None = None
    code_hash: str | None = None
    git_commit: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def filename(self) -> str:
        parts = (self.semantic_id, self.workload_id, self.run_label, self.candidate)
        return "__".join(p.replace("/", "_").replace(" ", "_") for p in parts) + ".json"


FIELDS = tuple(f.name for f in dataclasses.fields(Record))


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(resources.files("bp_mech.records").joinpath("schema/record.schema.json").read_text())


_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
          "object": dict, "null": type(None)}


def _type_ok(v, t: str) -> bool:
    if t in ("integer", "number") and isinstance(v, bool):
        return False
    return isinstance(v, _TYPES[t])


def schema_errors(s: dict, data: Any, path: tuple = ()) -> list[tuple[tuple, str]]:
    """The subset of JSON Schema the record schema uses (type, enum, const, minimum, minLength,
    pattern, required, properties, additionalProperties, items, allOf with if/then).

    Used where the ``jsonschema`` package is absent (the GPU machine runs from the source
    tree with what it has); the tests check it agrees with ``jsonschema``.
    """
    import re

    errs = []
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_type_ok(data, t) for t in types):
            return [(path, f"{data!r} is not of type {', '.join(map(repr, types))}")]
    if "enum" in s and data not in s["enum"]:
        errs.append((path, f"{data!r} is not one of {s['enum']!r}"))
    if "const" in s and data != s["const"]:
        errs.append((path, f"{s['const']!r} was expected"))
    if isinstance(data, (int, float)) and not isinstance(data, bool) and data < s.get("minimum", data):
        errs.append((path, f"{data!r} is less than the minimum of {s['minimum']!r}"))
    if isinstance(data, str):
        if len(data) < s.get("minLength", 0):
            errs.append((path, f"{data!r} is too short"))
        if "pattern" in s and not re.search(s["pattern"], data):
            errs.append((path, f"{data!r} does not match {s['pattern']!r}"))
    if isinstance(data, list) and "items" in s:
        for i, v in enumerate(data):
            errs += schema_errors(s["items"], v, path + (i,))
    if isinstance(data, dict):
        for k in s.get("required", []):
            if k not in data:
                errs.append((path, f"'{k}' is a required property"))
        props = s.get("properties", {})
        for k, v in data.items():
            if k in props:
                errs += schema_errors(props[k], v, path + (k,))
            elif s.get("additionalProperties", True) is False:
                errs.append((path, f"Additional properties are not allowed ('{k}' was unexpected)"))
    for sub in s.get("allOf", []):
        if "if" in sub and not schema_errors(sub["if"], data, path):
            errs += schema_errors(sub.get("then", {}), data, path)
    return errs


def validate(data: Any, where: str = "<record>") -> Record:
    """Validate a dict against the shipped schema and return the Record."""
    if not isinstance(data, dict):
        raise RecordError(f"{where}: a record must be a JSON object, got {type(data).__name__}")
    try:
        import jsonschema
    except ImportError:
        errors = schema_errors(schema(), data)
    else:
        errors = [(tuple(e.path), e.message) for e in jsonschema.Draft202012Validator(schema()).iter_errors(data)]
    if errors:
        path, message = sorted(errors, key=lambda e: [str(p) for p in e[0]])[0]
        name = ".".join(str(p) for p in path) or (message.split("'")[1] if "'" in message else "?")
        raise RecordError(f"{where}: field '{name}': {message}")
    return Record(**data)


def save_record(record: Record, out_dir: str | os.PathLike) -> Path:
    """Validate and write ``record`` atomically into ``out_dir``; return the path."""
    data = record.to_dict()
    validate(data, record.filename)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / record.filename
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=False, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json(path: Path) -> Any:
    """A record file's JSON, not yet validated (a ``RecordError`` for a file that cannot be read or parsed)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not valid JSON (truncated or corrupt?): {e.msg} at line {e.lineno}") from None


def load_record(path: str | os.PathLike) -> Record:
    return validate(read_json(Path(path)), str(path))


def load_records(directory: str | os.PathLike, semantic_id: str | None = None) -> list[tuple[Path, Record]]:
    """Every record under ``directory`` (validated), optionally of one experiment (then the others' are read,
    not validated: a bad one is refused where its own experiment's are loaded). A ``computed/`` folder holds
    computed records (``records.computed``), not run records, and is passed over."""
    d = Path(directory)
    if not d.exists():
        return []
    if not d.is_dir():
        raise RecordError(f"{d}: not a directory")
    out = []
    for p in sorted(d.rglob("*.json")):
        if "computed" in p.relative_to(d).parts[:-1]:
            continue
        data = read_json(p)
        if semantic_id is None or not isinstance(data, dict) or data.get("semantic_id") == semantic_id:
            out.append((p, validate(data, str(p))))
    return out


def check_mergeable(items: Iterable[tuple[Path, Record]]) -> None:
    """Refuse to compare records of different workloads or model commits."""
    items = list(items)
    if not items:
        return
    p0, r0 = items[0]
    for p, r in items[1:]:
        for name in ("workload_id", "model_commit"):
            if getattr(r, name) != getattr(r0, name):
                raise RecordError(
                    f"{p}: field '{name}' is {getattr(r, name)!r} but {p0.name} has {getattr(r0, name)!r}; "
                    "records of different workloads or model commits never go into one comparison"
                )


def json_safe(x):
    """Non-finite floats -> None, recursively (records are strict JSON; a diverged run must
    still save). Finiteness itself is recorded separately."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
