"""``bench.step``'s claim, held statically: every training loop of the package is the one training step.

A function under ``src/bp_mech`` that calls a backward (``.backward(...)``, or a function whose name ends in
``backward``, such as ``accumulated_backward``) and an optimizer's step (``X.step(...)`` on an optimizer or a
GradScaler, or ``scaler_step``) is a training loop of its own. Only ``bench.step`` may hold one, besides the
exceptions its module docstring lists (framework idioms, demonstrated mistakes, GradScaler references)."""

import ast
import re
from pathlib import Path

import bp_mech
from bp_mech.bench import step

SRC = Path(bp_mech.__file__).parent
# function (module:qualified name) -> why it keeps a loop of its own; bench.step's docstring names each one
EXCEPTIONS = {
    "bp_mech.accumulation_framework:accelerate_updates": "Accelerate's idiom (accelerator.backward inside accumulate)",
    "bp_mech.projects.baseline_loop:run_updates": "Accelerate's idiom, project 73's multi-process loop",
    "bp_mech.amp:clipping_order": "the mistake the AMP chapter shows: clipping before unscale_",
    "bp_mech.experiments.accumulation_updates:train_updates": "the naive mean-of-means normalisation, shown",
    "bp_mech.experiments.amp:conformance": "torch's GradScaler on one parameter, the scaler's reference",
}
EXEMPT_FOLDERS = ("checks",)  # the exercise checks: torch's own GradScaler and optimizers as references
OPTIMIZER = re.compile(r"(^|[._])(opt\w*|optimizer\w*|scaler)$")  # receivers whose .step() is an optimizer's
STEP_HELPERS = ("scaler_step", "apply_update")  # functions that step an optimizer (scheduler, bench.step)


def _calls(fn: ast.AST) -> tuple[bool, bool, set[str]]:
    """(calls a backward, calls an optimizer's step, the functions and self-methods it calls) in ``fn``."""
    backward = stepped = False
    names = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if isinstance(f, ast.Name) or isinstance(f, ast.Attribute) and ast.unparse(f.value) == "self":
            names.add(name)  # a call of the module's own function or method
        backward |= name.endswith("backward")
        stepped |= name in STEP_HELPERS or (
            name == "step" and isinstance(f, ast.Attribute) and bool(OPTIMIZER.search(ast.unparse(f.value))))
    return backward, stepped, names


def loops(source: str, module: str) -> set[str]:
    """``module:qualname`` of every function of ``source`` that calls a backward and an optimizer's step, itself
    or through the module's own functions it calls (``train_step`` steps in ``apply_update``), and calls no
    other such function of the module."""
    funcs = {}  # qualname -> (backward, stepped, called names); nested functions count for the outer one

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs[f"{prefix}{child.name}"] = _calls(child)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    local = {q.rsplit(".", 1)[-1]: q for q in funcs}
    reach = {q: {q} | {local[n] for n in funcs[q][2] if n in local} for q in funcs}
    for _ in funcs:  # the local call graph's closure
        reach = {q: set().union(*(reach[r] for r in rs)) for q, rs in reach.items()}
    loop = {q for q, rs in reach.items() if any(funcs[r][0] for r in rs) and any(funcs[r][1] for r in rs)}
    # a function that runs a loop by calling it (``probe`` calls ``train_step``) is not one itself
    return {f"{module}:{q}" for q in loop if not (reach[q] - {q}) & loop}


def package_loops() -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] in EXEMPT_FOLDERS:
            continue
        module = ".".join(("bp_mech", *rel.with_suffix("").parts)).removesuffix(".__init__")
        found |= loops(path.read_text(), module)
    return found


def test_every_training_loop_is_the_one_step_or_a_listed_exception():
    outside = sorted(package_loops() - {"bp_mech.bench.step:train_step"} - set(EXCEPTIONS))
    assert not outside, ("training loops outside bench.step.train_step (run them through it, e.g. "
                         f"bench.trainer.Trainer, or list them in bench.step's docstring and here): {outside}")


def test_the_one_step_and_every_exception_are_seen_and_named_in_bench_step():
    found = package_loops()
    assert "bp_mech.bench.step:train_step" in found  # the check sees a real loop
    stale = sorted(set(EXCEPTIONS) - found)
    assert not stale, f"listed exceptions that no longer train on their own (drop them): {stale}"
    doc = step.__doc__
    for name in EXCEPTIONS:
        short = name.removeprefix("bp_mech.").replace(":", ".")
        assert f"``{short}``" in doc, f"bench.step's docstring does not list {short}"


def test_the_check_sees_a_hand_written_loop_and_ignores_other_steps():
    src = '''
class AmpTrainer:
    def step(self, batch):
        self.scaler.scale(self.model(**batch).loss).backward()
        scaler_step(self.scaler, self.optimizer)

def naive(model, opt, b):
    accumulation.accumulated_backward(model, b, 2, "naive")
    opt.step()

def clocked(trainer, clock, prof, loss):
    loss.backward()
    clock.step(True); prof.step(); trainer.step()

def _update(opt):
    opt.step()

def split(model, opt, loss):  # the step in a helper of the same module
    loss.backward()
    _update(opt)

def driver(model, opt, b):  # runs a loop, is none
    naive(model, opt, b)
'''
    assert loops(src, "m") == {"m:AmpTrainer.step", "m:naive", "m:split"}
