"""Computed records: the values a page needs that are too expensive to compute on every build.

A fake-tensor trace of the 0.5B model under fifteen step definitions takes minutes; a page that showed it
by tracing it afresh would make every build of the book that slow. Such a value is computed once, by
``make records``, and saved as a *computed record* (``COMPUTED_DIR/<name>.json``): the value as JSON,
beside what it was computed from, like a run record's provenance:

* ``code_hash``: the hash of the module that computes it and of every ``bp_mech`` module it imports
  (``records.provenance.code_hash``, docstrings and comments aside);
* ``versions``: the torch and transformers it ran with (a fake trace follows their operators);
* ``inputs``: a digest of the files it read besides the code, where there are any.

``load`` gives the value back only while all three still match: a record computed by older code, other
library versions or other inputs is *stale*, and ``load`` refuses it with a ``StaleRecord`` that names the
record and says how to refresh it. The strict build therefore never shows a value the current code
would not compute, and a test loads every registered record (``tests/records/test_computed.py``).

Values are dataclasses (nested dataclasses, lists, tuples, dicts, numbers, strings), written with their
field names and read back into the same types from the dataclass's annotations (``encode``, ``decode``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bp_mech import RESULTS_DIR, __version__
from bp_mech.records import provenance
from bp_mech.records.results import RecordError

COMPUTED_DIR = RESULTS_DIR / "computed"  # one JSON file per computed record


class StaleRecord(RecordError):
    """A computed record that is missing, or was computed from other code, versions or inputs."""


@dataclass(frozen=True)
class Computation:
    """A value worth caching, and how to compute it.

    Example:
        >>> c = Computation("answer", "bp_mech.records.references", lambda: 42, int)
        >>> c.name, c.compute()
        ('answer', 42)
    """

    name: str  # the record's file name without .json, e.g. "reference-gap__TRAIN-CHECKPOINT"
    module: str  # the module that computes it: its code hash (with its imports) keys the record
    compute: Callable[[], Any]  # computes the value (minutes, perhaps)
    type: Any  # the value's type, to read it back (a dataclass, or a plain JSON type)
    inputs: tuple[Path, ...] = ()  # files it reads besides the code (their bytes key the record too)


def versions() -> dict[str, str]:
    """The library versions a computed value depends on.

    Example:
        >>> sorted(versions())
        ['torch', 'transformers']
    """
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def inputs_digest(paths) -> str | None:
    """SHA-256 over the names and bytes of ``paths`` (in order; a missing file counts as absent), or None
    when there are none.

    Example:
        >>> inputs_digest([]) is None
        True
    """
    paths = list(paths)
    if not paths:
        return None
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        h.update(p.name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"<absent>") + b"\0")
    return h.hexdigest()


def key(c: Computation) -> dict:
    """What a record of ``c`` must have been computed from to be current: code hash, versions, inputs."""
    return {"code_hash": provenance.code_hash(c.module), "versions": versions(), "inputs": inputs_digest(c.inputs)}


def path(c: Computation, directory: Path = COMPUTED_DIR) -> Path:
    """Where the record of ``c`` lives."""
    return Path(directory) / f"{c.name}.json"


def refresh(c: Computation, directory: Path = COMPUTED_DIR) -> Any:
    """Compute ``c`` and save its record (atomically: a temporary file, then a rename); returns the value."""
    value = c.compute()
    doc = {"name": c.name, "module": c.module, **key(c), "bp_mech_version": __version__,
           "git_commit": provenance.git_commit(), "value": encode(value)}
    target = path(c, directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, target)
    return value


def load(c: Computation, directory: Path = COMPUTED_DIR) -> Any:
    """The value of ``c``'s record, read back into ``c.type``.

    Raises:
        StaleRecord: the record is missing, or its code hash, versions or inputs differ from now's (the
            message names the record, what differs, and ``make records``).
    """
    p = path(c, directory)
    if not p.is_file():
        raise StaleRecord(f"{p}: no computed record {c.name!r}; run `make records` to compute it")
    doc = json.loads(p.read_text(encoding="utf-8"))
    now = key(c)
    changed = [k for k in now if doc.get(k) != now[k]]
    if changed:
        raise StaleRecord(f"{p}: stale computed record ({', '.join(changed)} changed since it was computed); "
                          "run `make records` to compute it again")
    return decode(c.type, doc["value"])


# --- the value as JSON and back ---------------------------------------------------------------------

def encode(x: Any) -> Any:
    """``x`` as JSON-able data: dataclasses as dicts of their fields, tuples as lists, non-finite floats as
    strings ("nan", "inf", "-inf").

    Example:
        >>> encode({"a": (1, 2.5, float("inf"))})
        {'a': [1, 2.5, 'inf']}
    """
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: encode(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    return x


def decode(tp: Any, x: Any) -> Any:
    """``encode``'s data read back as type ``tp`` (a dataclass, list/tuple/dict of them, Optional, a plain
    type or ``Any``).

    Example:
        >>> @dataclass
        ... class Row:
        ...     label: str
        ...     shape: tuple[int, ...]
        ...     saving: float | None
        >>> decode(list[Row], [{"label": "a", "shape": [2, 3], "saving": "nan"}])
        [Row(label='a', shape=(2, 3), saving=nan)]
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object or x is None:
        return x
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: decode(hints[f.name], x[f.name]) for f in dataclasses.fields(tp)
                     if f.init and f.name in x})
    if origin in (typing.Union, types.UnionType):
        for arg in (a for a in args if a is not type(None)):
            try:
                return decode(arg, x)
            except (TypeError, ValueError, KeyError):
                continue
        raise ValueError(f"{x!r} is none of {args}")
    if origin in (list, tuple) or tp in (list, tuple):
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v) for v in x)
        if origin is tuple and args:
            return tuple(decode(a, v) for a, v in zip(args, x))
        items = [decode(args[0] if args else Any, v) for v in x]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        kt, vt = args if args else (str, Any)
        return {(kt(k) if kt in (int, float) else k): decode(vt, v) for k, v in x.items()}
    if origin is typing.Literal:
        if x not in args:
            raise ValueError(f"{x!r} is not one of {args}")
        return x
    if tp is float:
        return float(x)
    if tp in (int, str, bool) and not isinstance(x, tp):
        raise TypeError(f"{x!r} is not a {tp.__name__}")
    return tp(x) if isinstance(tp, type) and tp not in (int, str, bool) else x
