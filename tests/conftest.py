"""Shared test fixtures.

``--impl`` picks which exercise solutions ``tests/checks/test_exercises.py`` checks: ``answers``
(default), ``exercises`` (the learner's stubs) or a directory holding ``exNN_*.py`` files.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import transformers.generation  # noqa: F401  (they read torch.cuda.Stream at import: before cpu_only
from transformers import AutoModelForCausalLM  # noqa: F401  replaces it; the model classes load lazily)

from bp_mech import ROOT


def pytest_addoption(parser):
    parser.addoption("--impl", default="answers",
                     help="answers | exercises | a directory with your exNN_<topic>.py files")


def load_solution(directory: Path, name: str):
    """Import ``directory/name.py`` as a fresh module (not cached across directories)."""
    path = directory / f"{name}.py"
    if not path.exists():
        pytest.fail(f"{path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_solution_{directory.name}_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def impl(request):
    """``impl("ex09_local_backward")`` -> the chosen solutions module."""
    which = request.config.getoption("--impl")
    directory = ROOT / which if which in ("answers", "exercises") else Path(which).resolve()
    return lambda name: load_solution(directory, name)


def mutant(name: str, **overrides):
    """The answers of exercise file ``name`` with some functions replaced: a wrong solution
    that a check must reject."""
    import types

    base = load_solution(ROOT / "answers", name)
    m = types.SimpleNamespace(**{k: v for k, v in vars(base).items() if not k.startswith("_")})
    m.__dict__.update(overrides)
    return m


CUDA_CALLS = ("synchronize", "Stream", "current_stream", "stream", "Event", "empty_cache", "reset_peak_memory_stats",
              "max_memory_allocated", "max_memory_reserved", "memory_allocated", "get_device_properties")


@pytest.fixture
def cpu_only(monkeypatch):
    """The CPU path must not touch ``torch.cuda`` (beyond ``is_available``), and its records must
    validate without ``jsonschema``, as on the GPU machine."""
    for name in CUDA_CALLS:
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: pytest.fail(f"torch.cuda.{_n} on the CPU"))
    monkeypatch.setitem(sys.modules, "jsonschema", None)


ALLOCATOR_CALLS = ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
                   "max_memory_reserved", "empty_cache")


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's allocator calls replaced by a log of their names; each returns the log's length:
    the CUDA paths of the trackers exercised on the CPU."""
    log = []
    for name in ALLOCATOR_CALLS:
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: log.append(_n) or len(log))
    return log


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    tiny steps gain nothing from more, and on a shared 2-core machine they only spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hooked_step(model, batch, hooks=None):
    """One training step of ``model`` without its update (the gradients stay), its saved tensors under
    ``hooks``: an offload's saved-tensor hooks standing in for the strategy's (None: the plain step)."""
    from bp_mech.bench.step import train_step
    from bp_mech.bench.strategy import PLAIN, Entered, Strategy

    s = PLAIN if hooks is None else Strategy(offload=True)
    return train_step(model, None, batch, s, entered=Entered(model, s, "cpu", hooks=hooks), update=False)


def hooked_probe(model, batch, hooks=None):
    """``bench.step.probe`` of that step: loss, gradients, calls, saved bytes."""
    from bp_mech.bench.step import probe
    from bp_mech.bench.strategy import PLAIN, Entered, Strategy

    s = PLAIN if hooks is None else Strategy(offload=True)
    return probe(model, batch, s, entered=Entered(model, s, "cpu", hooks=hooks))


def one_error_line(capsys) -> str:
    """The one line a refused command wrote to stderr (and no traceback)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def gpu_suite_ids() -> list[str]:
    """The semantic ids of the GPU suite, in its order."""
    from bp_mech.records import registry

    return [e.semantic_id for e in registry.gpu_suite()]


@pytest.fixture(scope="module")
def tiny():
    """A tiny random-init Qwen2 (``tiny-b2s32``) and two batches, built once per test module."""
    from bp_mech.instruments.workload import build_model, make_batches, parse_workload

    w = parse_workload("tiny-b2s32")
    return build_model(w), make_batches(w, 2)


@pytest.fixture(autouse=True)
def _mutants_unshrunk(monkeypatch):
    """A mutant only has to be rejected: hypothesis's shrinking of its counterexample is skipped in tests
    (``bp_mech.checks.properties.SHRINK``); a learner's ``bp-mech check`` still shrinks."""
    from bp_mech.checks import properties

    monkeypatch.setattr(properties, "SHRINK", False)


# the tests that read the build (tools/book_build.current_build): on the worker that builds it, never waiting
# on the other
BOOK_TESTS = ("tests/test_book.py", "tests/test_browser.py", "tests/test_browser_audit.py", "tests/test_rendered_pages.py",
              "tests/book/test_calculator_page.py")


def test_group(nodeid: str) -> str:
    """The unit a worker runs whole: the book's build with the tests that read it, else the test file."""
    path = nodeid.split("::")[0]
    return "book" if path in BOOK_TESTS else path


def pytest_collection_modifyitems(config, items):
    """The book's build and the tests that read it first (``make test``'s worker that takes them builds the
    book while the other worker takes the rest); otherwise pytest's own order."""
    items.sort(key=lambda item: test_group(item.nodeid) != "book")  # (stable: the rest keeps its order)


def pytest_xdist_make_scheduler(config, log):
    """Under ``pytest -n 2`` (``make test``): each test file runs whole on one worker (its module fixtures are
    built once), and the book group on one worker. (xdist's own ``loadgroup`` no longer groups under pytest 9,
    whose node ids ignore the group suffix xdist writes: this scheduler does not depend on it.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    return ByGroup(config, log)
