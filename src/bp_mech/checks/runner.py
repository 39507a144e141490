"""``bp-mech check NN``: one line per exercise function, in words.

The checks of chapter NN live in ``src/bp_mech/checks/exNN.py`` (listed in ``src/bp_mech/checks/__init__.py``'s
``CHAPTERS``). Each check is named after the ONE exercise function it tests, ``check_<function>`` or
``check_<function>__<aspect>``; ``check_chapter`` runs them in-process on the learner's file and
groups them by function (an engine check carries the function its declaration grades, ``.tests``):

    PASS linear_backward
    TODO silu_backward: not implemented yet
    FAIL rmsnorm_backward: dx differs from float64 autograd, max rel error 3.1e-01 > 1e-10 at shape (2, 8, 16)
    1 of 3 functions pass, 1 not implemented yet, 1 failing

A function's line is its first check that does not pass: an AssertionError gives its one-line
message (the first mismatch in words), NotImplementedError gives TODO, any other exception is a FAIL
with its type, message and the line of the learner's file it came from. A check whose name follows
no function of the exercise file is mapped by the one exercise function it calls (``mapping``);
one that still maps to none gets its own line under its own name.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
import traceback
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from bp_mech import ROOT

STATUSES = ("PASS", "TODO", "FAIL")


class CheckError(ValueError):
    """Bad input to ``bp-mech check``: an unknown chapter, a missing directory or file."""


@dataclass(frozen=True)
class Line:
    """The verdict on one exercise function."""

    function: str  # the exercise function (or class); a check that maps to none: the check's own name
    status: str  # "PASS" | "TODO" (not implemented yet) | "FAIL"
    message: str = ""  # TODO/FAIL: what the learner reads after the colon; PASS: ""
    checks: tuple[str, ...] = ()  # the checks that test this function, in run order

    def __str__(self) -> str:
        return f"{self.status} {self.function}" + (f": {self.message}" if self.message else "")


# --- which checks, which functions --------------------------------------------------------


def _checks_package():
    """``bp_mech.checks``: the checks ship with the package."""
    return importlib.import_module("bp_mech.checks")


def marker(chapter: str) -> str:
    """The pytest marker of a chapter: ``"09"`` -> ``"ch09"``, ``"amp"`` -> ``"amp"``."""
    from bp_mech.records import registry

    try:
        number = registry.by_number(str(chapter)).number
    except registry.RegistryError as e:
        raise CheckError(str(e)) from None
    return number if not number.isdigit() else f"ch{number}"


def chapter_checks(chapter: str) -> tuple[str, list]:
    """(exercise file name without .py, its checks in ``CHECKS`` order)."""
    m = marker(chapter)
    package = _checks_package()
    for mark, module, name in package.CHAPTERS:
        if mark == m:
            return name, list(package.module(module).CHECKS)
    raise CheckError(f"chapter {chapter} has no exercise checks yet (src/bp_mech/checks/__init__.py lists none for {m})")


def exercise_functions(name: str) -> list[str]:
    """The public functions and classes of ``exercises/<name>.py``, in file order (read, not run)."""
    path = ROOT / "exercises" / f"{name}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()  # UpdateClock -> update_clock


def _by_name(check_name: str, functions: list[str]) -> str | None:
    """The function a convention name ``check_<function>[__<aspect>]`` names (a class by its snake_case too)."""
    rest = check_name.removeprefix("check_")
    for fn in sorted(functions, key=len, reverse=True):  # longest first: a name that prefixes another loses
        for key in {fn, _snake(fn)}:
            if rest == key or rest.startswith(key + "__"):
                return fn
    return None


def _uses(fn, param: str, seen: set) -> list[str]:
    """Attributes of ``param`` that ``fn`` reads (``m.split``), following helpers it passes ``param`` to."""
    if fn in seen:
        return []
    seen.add(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == param:
            found.append(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            helper = getattr(fn, "__globals__", {}).get(node.func.id)
            params = list(inspect.signature(helper).parameters) if inspect.isfunction(helper) else []
            for i, arg in enumerate(node.args[: len(params)]):
                if isinstance(arg, ast.Name) and arg.id == param:
                    found += _uses(helper, params[i], seen)
    return found


def _by_calls(check, functions: list[str]) -> str | None:
    """The one exercise function a check calls on the solutions module, or None (none, or several)."""
    params = list(inspect.signature(check).parameters)
    called = [f for f in dict.fromkeys(_uses(check, params[0], set())) if f in functions] if params else []
    return called[0] if len(called) == 1 else None


def mapping(chapter: str) -> list[tuple[str, str | None, str]]:
    """(check name, function or None, how: "declared" | "name" | "calls" | "none") for every check of a
    chapter. ``how`` says whether the check's declaration names its function (``engine.Contract``), its name
    follows the convention or the function was found by what it calls."""
    name, checks = chapter_checks(chapter)
    return _map_checks(checks, exercise_functions(name))


def _map_checks(checks: list, functions: list[str]) -> list[tuple[str, str | None, str]]:
    """``mapping``'s rows for ``checks`` against the exercise file's ``functions``."""
    rows = []
    for c in checks:
        if (fn := getattr(c, "tests", None)) in functions:  # an engine check: its declaration names it
            rows.append((c.__name__, fn, "declared"))
        elif fn := _by_name(c.__name__, functions):
            rows.append((c.__name__, fn, "name"))
        elif fn := _by_calls(c, functions):
            rows.append((c.__name__, fn, "calls"))
        else:
            rows.append((c.__name__, None, "none"))
    return rows


# --- running ------------------------------------------------------------------------------


def solutions_dir(directory=None) -> Path:
    """The folder of the learner's files: ``exercises/`` by default; ``"exercises"`` and ``"answers"``
    name the repository's folders, anything else is a path (relative to the current directory)."""
    if directory is None or str(directory) in ("exercises", "answers"):
        return ROOT / (str(directory) if directory is not None else "exercises")
    return Path(directory).resolve()


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_bp_mech_check_{abs(hash(str(path)))}_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a dataclass in the learner's file looks its module up there
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return mod


def _learner_frame(exc: BaseException, path: Path):
    """The deepest traceback frame of ``exc`` (or of the exception it was raised from) in the learner's file."""
    for e in (exc, exc.__cause__):
        if e is None:
            continue
        frames = [f for f, _ in traceback.walk_tb(e.__traceback__) if Path(f.f_code.co_filename).resolve() == path]
        if frames:
            return frames[-1]
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _where(frame, path: Path) -> str:
    return f"{path.name} line {frame.f_lineno}"


def _verdict(fn: str, check, exc: BaseException, path: Path) -> tuple[str, str]:
    """(status, message) of a check that raised ``exc`` on ``fn``."""
    frame = _learner_frame(exc, path)
    if isinstance(exc, NotImplementedError):
        owner = getattr(frame.f_code, "co_qualname", frame.f_code.co_name).split(".")[0] if frame else fn
        return "TODO", ("not implemented yet" if owner in (fn, "<module>") else f"needs {owner}, not implemented yet")
    last = traceback.extract_tb(exc.__traceback__)[-1]  # where it was raised
    if frame is not None and (not isinstance(exc, AssertionError) or Path(last.filename).resolve() == path):
        return "FAIL", f"{type(exc).__name__}: {_first_line(exc)} ({_where(frame, path)})"
    if isinstance(exc, AssertionError):
        msg = _first_line(exc)
        if not msg:
            msg = f"{check.__name__} failed (an assertion without a message, {Path(last.filename).name} line {last.lineno})"
        msg = re.sub(rf"^{re.escape(fn)}(:\s*|\s+)", "", msg)  # the line already names the function
        return "FAIL", msg + (f" ({_where(frame, path)})" if frame is not None else "")
    where = f"in the check {check.__name__}, {Path(last.filename).name} line {last.lineno}"  # e.g. a wrong return type
    return "FAIL", f"{type(exc).__name__}: {_first_line(exc)} ({where})"


@contextlib.contextmanager
def _isolated():
    """The caller's torch RNG, default dtype and thread count survive the checks (a chapter's kernel)."""
    import torch

    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)


def check_chapter(chapter: str, directory=None) -> list[Line]:
    """Run chapter ``chapter``'s checks on ``directory/<exercise file>`` (default ``exercises/``;
    ``"answers"`` and ``"exercises"`` name the repository's folders), one ``Line`` per exercise
    function in file order, then one per check that maps to no function."""
    name, checks = chapter_checks(chapter)
    d = solutions_dir(directory)
    path = (d / f"{name}.py").resolve()
    if not d.is_dir():
        raise CheckError(f"{d}: no such directory")
    if not path.exists():
        raise CheckError(f"{path} does not exist (copy exercises/{name}.py there and solve it)")
    functions = exercise_functions(name)
    by_check = {c: fn for c, fn, _ in _map_checks(checks, functions)}
    groups: dict[str, list] = {fn: [] for fn in functions}
    for c in checks:
        groups.setdefault(by_check[c.__name__] or c.__name__, []).append(c)
    try:
        mod = _load(path)
    except Exception as e:  # noqa: BLE001 (a learner's file that does not import: every function fails)
        line = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else None
        frame = _learner_frame(e, path)
        where = f"line {line}" if line else (f"line {frame.f_lineno}" if frame else "")
        msg = f"{path.name} does not import: {type(e).__name__}: {_first_line(e)}" + (f" ({where})" if where else "")
        return [Line(fn, "FAIL", msg, tuple(c.__name__ for c in cs)) for fn, cs in groups.items()]
    out = []
    with _isolated():
        for fn, cs in groups.items():
            names = tuple(c.__name__ for c in cs)
            if not cs:
                out.append(Line(fn, "FAIL", "no check tests this function (tell the maintainers)", names))
                continue
            if fn in functions and not hasattr(mod, fn):
                out.append(Line(fn, "FAIL", f"{path.name} defines no {fn}", names))
                continue
            status, msg = "PASS", ""
            for c in cs:
                try:
                    c(mod)
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001 (pytest.fail, SystemExit from a learner's file, ...)
                    status, msg = _verdict(fn, c, e, path)
                    break
            out.append(Line(fn, status, msg, names))
    return out


def format_report(lines: list[Line]) -> str:
    """The lines and a summary line, e.g. ``2 of 5 functions pass, 3 not implemented yet, 0 failing``."""
    n = {s: sum(line.status == s for line in lines) for s in STATUSES}
    total = f"{len(lines)} functions pass" if len(lines) != 1 else "1 function passes"
    summary = f"{n['PASS']} of {total}, {n['TODO']} not implemented yet, {n['FAIL']} failing"
    return "\n".join([*map(str, lines), summary])


def exit_code(lines: list[Line]) -> int:
    """0 only when every function passes."""
    return 0 if lines and all(line.status == "PASS" for line in lines) else 1


@cache
def sample_output(chapter: str) -> str:
    """What ``bp-mech check NN`` prints on the untouched stubs of ``exercises/``, after its command line
    (a chapter prints it at build time)."""
    return f"$ bp-mech check {chapter}\n" + format_report(check_chapter(chapter, ROOT / "exercises"))
