"""The executor of ``tools/mutation.py``: cosmic-ray's mutants, each judged by one chapter's checks in a fork.

cosmic-ray enumerates the mutants of the graded files (``cosmic_ray.commands.init``, into its sqlite session) and
applies each one on disk (``cosmic_ray.mutating.use_mutation``, which puts the original back), in a scratch copy of
the repository: the checkout others work in is never mutated. cosmic-ray's own ``exec`` starts a Python process per
mutant, and torch, transformers and the checks take about 8 s to import on two cores; instead this process imports
the third-party modules the checks need once (never ``bp_mech``: its import registers torch ops that a second import
would refuse) and forks one child per mutant. The child imports ``bp_mech`` from the mutated copy, with no bytecode
cache (a mutant of the original's size written within the same second must not be read back as the original), and
runs the chapter's checks exactly as ``tests/checks/test_exercises.py`` does (``bp_mech.checks.cases()``: each check
on a freshly loaded answers module), stopping at the first that fails. A child that outlives the per-mutant timeout
is ended by SIGALRM (its default action also ends code stuck in C). ``describe`` names a mutant for the report.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

COPIED = ("src", "answers", "exercises", "pyproject.toml")  # what the checks read (bp_mech.ROOT is the copy)
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".hypothesis")
SCRATCH = Path(os.environ.get("BP_MECH_MUTATION_DIR", "/tmp/bp-mech-mutation"))
PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bp_mech.checks import cases
chapters = {}
for p in cases():
    chapters.setdefault(p.marks[0].name, p.values[0])
third = sorted(m for m in sys.modules if m.split(".")[0] not in ("bp_mech", "__main__") and not m.startswith("_"))
print(json.dumps({"chapters": chapters, "modules": third}))
"""


@dataclass(frozen=True)
class Verdict:
    """What one run of a chapter's checks said."""

    outcome: str  # "survived" (every check passed) | "killed" (a check failed) | "timeout"
    message: str  # killed: "<check>: <exception type>: <first line>"; else ""
    seconds: float  # wall time of the run


def tree_hash(root: Path) -> str:
    """SHA-256 over every copied file: a change anywhere starts a fresh session instead of resuming one."""
    h = hashlib.sha256()
    for name in COPIED:
        path = root / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if "__pycache__" not in f.parts and f.suffix != ".pyc" and ".egg-info" not in str(f):
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def scratch_copy(root: Path) -> Path:
    """A fresh copy of what the checks read, under ``SCRATCH/<tree hash>``; its sessions (``*.sqlite``) are kept."""
    dest = SCRATCH / tree_hash(root)[:16]
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src, target = root / name, dest / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        if src.is_dir():
            shutil.copytree(src, target, ignore=IGNORED)
        else:
            shutil.copy2(src, target)
    return dest


def prepare(copy: Path) -> dict[str, str]:
    """Import, once, the third-party modules the checks use; return ``{marker: exercise file name}``.

    A subprocess imports ``bp_mech.checks`` from the copy and lists what it imported; this process imports those
    modules (not ``bp_mech``) so that each forked child only imports the project's own code.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per run: the machine is shared
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.dont_write_bytecode = True
    out = subprocess.run([sys.executable, "-c", PROBE, str(copy / "src")], capture_output=True, text=True,
                         check=True, cwd=copy)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    for name in probe["modules"]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (a module that only imports as part of its package: the child will)
            pass
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(copy / "src"))
    assert "bp_mech" not in sys.modules, "bp_mech must be imported in each child, never in the parent"
    return probe["chapters"]


def _load(path: Path):
    """``path`` as a fresh module, registered (a dataclass in it looks its module up in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(f"_mutation_solution_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300]


def _child(copy: Path, marker: str) -> tuple[int, str]:
    """Run the chapter's checks on the (possibly mutated) answers of the copy: (exit code, message)."""
    import bp_mech

    assert Path(bp_mech.__file__).resolve().is_relative_to(copy.resolve()), bp_mech.__file__
    from bp_mech.checks import cases

    for p in cases():
        if p.marks[0].name != marker:
            continue
        name, check = p.values
        try:
            check(_load(copy / "answers" / f"{name}.py"))
        except BaseException as e:  # noqa: BLE001  (an import error of a mutant kills it too)
            return 1, f"{getattr(check, '__name__', check)}: {_first_line(e)}"
    return 0, ""


def run_checks(copy: Path, marker: str, timeout: int) -> Verdict:
    """The chapter's checks on the copy as it is on disk now, in a forked child with an alarm."""
    read, write = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        code, message = 1, "child failed"
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(timeout)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            code, message = _child(copy, marker)
        except BaseException as e:  # noqa: BLE001
            message = f"runner: {_first_line(e)}"
        finally:
            os.write(write, message.encode()[:4000])
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode(errors="replace")
    seconds = time.perf_counter() - start
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGALRM:
            return Verdict("timeout", "", seconds)
        return Verdict("killed", f"ended by signal {signal.Signals(sig).name}", seconds)
    code = os.WEXITSTATUS(status)
    return Verdict("survived" if code == 0 else "killed", message, seconds)


def qualname(tree: ast.Module, line: int) -> str:
    """The innermost function or class around ``line``, dotted (``UpdateClock.step``)."""
    names, body = [], tree.body
    while True:
        inner = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and min([n.lineno] + [d.lineno for d in n.decorator_list]) <= line <= n.end_lineno]
        if not inner:
            return ".".join(names) or "<module>"
        names.append(inner[0].name)
        body = inner[0].body


def describe(rel: str, definition: str, diff: str) -> str:
    """A mutant's stable name: ``<file>::<definition>: `<line before>` -> `<line after>```."""
    lines = diff.splitlines()
    before = " / ".join(x[1:].strip() for x in lines if x.startswith("-") and not x.startswith("---"))
    after = " / ".join(x[1:].strip() for x in lines if x.startswith("+") and not x.startswith("+++"))
    return f"{rel}::{definition}: `{before}` -> `{after}`"


def order(item) -> tuple:
    """Mutants in file, position, operator and occurrence order (cosmic-ray's own order is random)."""
    m = item.mutations[0]
    return str(m.module_path), m.start_pos, m.operator_name, m.occurrence


def execute(copy: Path, marker: str, db, timeout: int, progress=print) -> None:
    """Run every pending mutant of the session ``db`` and store its result (cosmic-ray's ``WorkResult``)."""
    import difflib

    from cosmic_ray.mutating import use_mutation
    from cosmic_ray.plugins import get_operator
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    pending = sorted(db.pending_work_items, key=order)
    for i, item in enumerate(pending, 1):
        m = item.mutations[0]
        with use_mutation(Path(m.module_path), get_operator(m.operator_name)(**(m.operator_args or {})),
                          m.occurrence) as (original, mutated):
            if mutated is None:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.NO_TEST))
                continue
            v = run_checks(copy, marker, timeout)
        rel = Path(m.module_path).resolve().relative_to(copy.resolve()).as_posix()
        diff = "\n".join(difflib.unified_diff(original.split("\n"), mutated.split("\n"), f"a/{rel}", f"b/{rel}",
                                              lineterm="", n=0))
        outcome = TestOutcome.SURVIVED if v.outcome == "survived" else TestOutcome.KILLED
        output = f"{v.outcome} {v.seconds:.2f}s\n{v.message}"
        db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=outcome,
                                              output=output, diff=diff))
        progress(f"[{marker} {i}/{len(pending)}] {v.outcome:8} {v.seconds:5.1f}s {rel}:{m.start_pos[0]} "
                 f"{m.operator_name}")
