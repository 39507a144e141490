"""Computed records: the values a page needs that are too expensive to compute on every build.

A fake-tensor trace of the 0.5B model under fifteen step definitions takes minutes; a page that traced it
afresh would make every build of the book that slow. Such a value is asked for through ``cached(name, fn,
*args, **kwargs)``: the page names it and says how it is computed, and gets it from its *computed record*
(``COMPUTED_DIR/<name>.json``), which holds the value as JSON beside what it was computed from:

* ``code_hash``: the hash of ``fn``'s module and of every ``bp_mech`` module it imports
  (``records.provenance.code_hash``, docstrings and comments aside);
* ``versions``: the torch and transformers it ran with (a fake trace follows their operators);
* ``arguments``: a digest of the arguments it was called with (``workers`` and ``progress`` aside);
* ``inputs``: a digest of the files it read besides the code (a plan reads the cached GPU records).

The value is given back only while all four still match. Otherwise the record is *stale* (or missing) and
``cached`` refuses it with a ``StaleRecord`` that names it and says how to refresh it, so the strict build
never shows a value the current code would not compute; ``make records`` runs the pages once with
``BP_MECH_COMPUTE=refresh`` in the environment, where ``cached`` computes each value and saves its record
instead. ``tests/records/test_computed.py`` checks every committed record against the current code.

Values are dataclasses (nested dataclasses, lists, tuples, dicts, numbers, strings), written with their
field names and read back into the same types from ``fn``'s return annotation (``encode``, ``decode``).
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
from pathlib import Path
from typing import Any, Callable

from bp_mech import RESULTS_DIR, __version__
from bp_mech.records import provenance
from bp_mech.records.results import RecordError

COMPUTED_DIR = RESULTS_DIR / "computed"  # one JSON file per computed record
REFRESH_ENV = "BP_MECH_COMPUTE"  # "refresh": ``cached`` computes and saves instead of reading
UNHASHED_ARGUMENTS = ("workers", "progress")  # how a value is computed, not which value


class StaleRecord(RecordError):
    """A computed record that is missing, or was computed from other code, versions, arguments or inputs."""


def versions() -> dict[str, str]:
    """The library versions a computed value depends on.

    Example:
        >>> sorted(versions())
        ['torch', 'transformers']
    """
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def digest(data: Any) -> str:
    """SHA-256 of ``encode(data)`` as canonical JSON (a config object by its ``to_dict()``).

    Example:
        >>> digest({"b": 1, "a": (2,)}) == digest({"a": [2], "b": 1})
        True
    """
    text = json.dumps(encode(data), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def inputs_digest(paths) -> str | None:
    """SHA-256 over the names and bytes of ``paths`` (sorted by name), or None when there are none.

    Example:
        >>> inputs_digest([]) is None
        True
    """
    paths = sorted(Path(p) for p in paths)
    if not paths:
        return None
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"<absent>") + b"\0")
    return h.hexdigest()


def key(fn: Callable, args: tuple, kwargs: dict, inputs=()) -> dict:
    """What a record of ``fn(*args, **kwargs)`` must have been computed from to be current."""
    hashed = {k: v for k, v in kwargs.items() if k not in UNHASHED_ARGUMENTS}
    return {"code_hash": provenance.code_hash(fn.__module__), "versions": versions(),
            "arguments": digest([fn.__qualname__, list(args), hashed]), "inputs": inputs_digest(inputs)}


def path(name: str, directory: Path = COMPUTED_DIR) -> Path:
    """Where the computed record ``name`` lives."""
    return Path(directory) / f"{name}.json"


def save(name: str, fn: Callable, value: Any, now: dict, directory: Path = COMPUTED_DIR) -> None:
    """Write the record of ``value`` (atomically: a temporary file, then a rename)."""
    doc = {"name": name, "module": fn.__module__, "function": fn.__qualname__, **now,
           "bp_mech_version": __version__, "git_commit": provenance.git_commit(), "value": encode(value)}
    target = path(name, directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, target)


def stale_fields(doc: dict, now: dict) -> list[str]:
    """The fields of ``now`` (code_hash, versions, arguments, inputs) that ``doc`` holds otherwise."""
    return [k for k in now if doc.get(k) != now[k]]


def cached(name: str, fn: Callable, *args, inputs=(), directory: Path = COMPUTED_DIR, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` as the computed record ``name`` holds it.

    Args:
        name: the record's name (its file ``<directory>/<name>.json``).
        fn: the function that computes the value; its return annotation is the value's type.
        *args: its positional arguments.
        inputs: files it reads besides the code (their bytes key the record too).
        directory: where the records live.
        **kwargs: its keyword arguments (``workers`` and ``progress`` do not key the record).

    Returns:
        The value, read back into ``fn``'s return type; with ``BP_MECH_COMPUTE=refresh``, computed now and
        saved first.

    Raises:
        StaleRecord: the record is missing, or its code hash, versions, arguments or inputs differ from
            now's (the message names the record, what differs, and ``make records``).

    Example:
        >>> import statistics, tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> os.environ[REFRESH_ENV] = "refresh"; cached("mid", statistics.median, [3, 1, 2], directory=d)
        2
        >>> del os.environ[REFRESH_ENV]; cached("mid", statistics.median, [3, 1, 2], directory=d)  # read back
        2
        >>> cached("mid", statistics.median, [3, 1, 5], directory=d)  # other arguments: refused
        Traceback (most recent call last):
        ...
        bp_mech.records.computed.StaleRecord: ...mid.json: stale computed record (arguments changed ...
    """
    now = key(fn, args, kwargs, inputs)
    p = path(name, directory)
    if os.environ.get(REFRESH_ENV) == "refresh":
        save(name, fn, fn(*args, **kwargs), now, directory)
    if not p.is_file():
        raise StaleRecord(f"{p}: no computed record {name!r}; run `make records` to compute it")
    doc = json.loads(p.read_text(encoding="utf-8"))
    changed = stale_fields(doc, now)
    if changed:
        raise StaleRecord(f"{p}: stale computed record ({', '.join(changed)} changed since it was computed); "
                          "run `make records` to compute it again")
    try:
        tp = typing.get_type_hints(fn).get("return", Any)
    except TypeError:  # a builtin: no annotations
        tp = Any
    return decode(tp, doc["value"])


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
    if callable(getattr(x, "to_dict", None)):  # a Transformers config
        return encode(x.to_dict())
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
        >>> @dataclasses.dataclass
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
