"""The tests mirror ``src/bp_mech``: every module with logic has its test file.

``src/bp_mech/<module>.py`` is tested in ``tests/test_<module>.py``, ``src/bp_mech/<folder>/<module>.py`` in
``tests/<folder>/test_<module>.py``. A module has logic when it defines a function or a class at its top
level (constants and re-exports are not logic). Two other homes are allowed, each stated here with its
reason: the exercise checks of a chapter (``checks/exNN*.py``: the checks module, its contract, variant and
measurement parts) are held together by that chapter's ``tests/checks/test_contract_NN.py``, which runs each
check on the answers and on mutants; and the modules in ``EXCEPTIONS``, each with the test that holds it.
"""

import ast
import re
from pathlib import Path

import bp_mech

SRC = Path(bp_mech.__file__).parent
TESTS = Path(__file__).parent
CHAPTER_CHECKS = re.compile(r"checks/ex(\d\d|_amp)(_contract|_variant|_measure)?\.py")

# module (relative to src/bp_mech) -> why it has no mirror file, and which test holds its logic
EXCEPTIONS = {
    "checks/__init__.py": "its one function, cases(), is what tests/checks/test_exercises.py is parametrized by",
    "experiments/amp_overflow.py": "AMP's overflow sample, run end to end by tests/experiments/test_amp.py "
                                   "(test_overflow_sample_semantics; overflow_failure case by case)",
    "experiments/continual_pretrain_conformance.py": "Part 02 · 56's conformance row (minutes of Accelerate runs), run "
                                                     "end to end by tests/experiments/test_continual_pretrain.py "
                                                     "(test_conformance_passes)",
    "projects/baseline_flops.py": "project 73's FLOP count, held by tests/projects/test_baseline_page.py (against "
                                  "torch's FlopCounterMode, MFU, the matmul rate)",
    "projects/baseline_loop.py": "project 73's loop on Accelerate, run end to end (one and two processes) by "
                                 "tests/projects/test_baseline.py",
    "projects/diagnosis.py": "project 74's diagnosis, held by tests/projects/test_profiling.py (ledger rows, dominant "
                             "state, backward moment, remedies within tolerance)",
    "projects/operators.py": "project 74's operator table, held by tests/projects/test_profiling.py (medians per "
                             "step, device time, the hot-spot list)",
    "projects/step_profile.py": "project 74's profiled step, run end to end by tests/projects/test_profiling.py "
                                "(trace, timeline, live bytes by category)",
    "projects/pareto.py": "project 76's decision, held by tests/projects/test_memory_strategy.py (the front against "
                          "brute-force dominance, the budget rule, noise)",
}


def has_logic(source: str) -> bool:
    """A function or class defined at the module's top level."""
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in ast.parse(source).body)


def mirror(rel: Path) -> Path:
    """The test file of module ``rel`` (relative to ``src/bp_mech``), relative to ``tests``."""
    return rel.parent / f"test_{rel.stem}.py"


def home(rel: Path) -> Path:
    """Where module ``rel``'s tests live: a chapter's contract test for its checks, else its mirror."""
    m = CHAPTER_CHECKS.fullmatch(rel.as_posix())
    return Path("checks") / f"test_contract_{m[1].lstrip('_')}.py" if m else mirror(rel)


def modules_with_logic() -> list[Path]:
    return sorted(p.relative_to(SRC) for p in SRC.rglob("*.py")
                  if "__pycache__" not in p.parts and has_logic(p.read_text(encoding="utf-8")))


def test_every_module_with_logic_has_its_test_file():
    missing = [f"{rel} -> tests/{home(rel)}" for rel in modules_with_logic()
               if rel.as_posix() not in EXCEPTIONS and not (TESTS / home(rel)).exists()]
    assert not missing, "modules with logic and no test file:\n" + "\n".join(missing)


def test_every_exception_is_still_one():
    """An exception names an existing module with logic and no mirror file (else it is out of date)."""
    logic = {rel.as_posix() for rel in modules_with_logic()}
    stale = [name for name in EXCEPTIONS if name not in logic or (TESTS / mirror(Path(name))).exists()]
    assert not stale, f"EXCEPTIONS that no longer apply: {stale}"


def test_the_rule_itself():
    assert has_logic("def f():\n    pass\n") and has_logic("class C:\n    pass\n")
    assert not has_logic('"""Doc."""\nfrom x import y\nZ = 1\n__all__ = ["y"]\n')
    assert mirror(Path("scheduler.py")) == Path("test_scheduler.py")
    assert mirror(Path("bench/step.py")) == Path("bench/test_step.py")
    assert home(Path("checks/ex43_measure.py")) == Path("checks/test_contract_43.py")
    assert home(Path("checks/ex_amp_variant.py")) == Path("checks/test_contract_amp.py")
    assert home(Path("checks/common.py")) == Path("checks/test_common.py")
