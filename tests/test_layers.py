"""The package's import graph (the layout of ``bp_mech/__init__.py``): imports run down the layers, never
up, and no module imports itself back through others. A layer is a folder of the package (its top-level
modules are the mechanisms); every ``bp_mech`` import counts, including those inside functions."""

import ast
import graphlib
from pathlib import Path

import bp_mech

SRC = Path(bp_mech.__file__).parent
# lowest first; a module may import its own layer and the ones before it. Each is a folder of the package,
# but for "package" (bp_mech/__init__.py), "mechanisms" (the modules at the top: bp_mech.<mechanism>) and "cli"
LAYERS = ["package", "instruments", "mechanisms", "bench", "records", "planner", "experiments", "projects", "book",
          "checks", "cli"]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def layer(module: str) -> str:
    rest = module.removeprefix("bp_mech").lstrip(".")
    if not rest:
        return "package"
    top = rest.split(".")[0]
    if top in ("cli", "__main__"):
        return "cli"
    return top if "." in rest or (SRC / top).is_dir() else "mechanisms"


def imports(module: str) -> set[str]:
    """The bp_mech modules ``module`` imports (a name imported from a module counts as that module)."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bp_mech"):
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("bp_mech")]
        else:
            continue
        for name in names:
            while name not in MODULES:
                name = name.rpartition(".")[0]
            if name != module:
                out.add(name)
    return out


GRAPH = {m: imports(m) for m in MODULES}


def test_the_layers_cover_the_package():
    assert layer("bp_mech.offload") == "mechanisms" and layer("bp_mech.bench.step") == "bench"
    assert layer("bp_mech.instruments.workload") == "instruments" and layer("bp_mech.cli") == "cli"
    assert {layer(m) for m in MODULES} == set(LAYERS)


def test_imports_run_down_the_layers():
    up = [f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, targets in GRAPH.items() for t in targets
          if LAYERS.index(layer(t)) > LAYERS.index(layer(m))]
    assert not up, "\n".join(sorted(up))


def test_a_mechanism_never_reports_to_the_tracker():
    """The storage tracker observes a mechanism (the offload's host copies through the ``host_region`` the
    bench hands it), so no mechanism imports it."""
    reporting = [m for m, targets in GRAPH.items() if layer(m) == "mechanisms" and "bp_mech.instruments.tracking" in targets]
    assert not reporting


def test_no_import_cycles():
    graphlib.TopologicalSorter(GRAPH).prepare()  # raises CycleError, naming one cycle


def test_the_check_sees_an_upward_import_and_a_cycle():
    graph = dict(GRAPH, **{"bp_mech.offload": GRAPH["bp_mech.offload"] | {"bp_mech.bench.step"}})
    assert LAYERS.index(layer("bp_mech.bench.step")) > LAYERS.index(layer("bp_mech.offload"))
    cyclic = dict(graph, **{"bp_mech.bench.step": graph["bp_mech.bench.step"] | {"bp_mech.offload"}})
    try:
        graphlib.TopologicalSorter(cyclic).prepare()
    except graphlib.CycleError:
        return
    raise AssertionError("a cycle went unseen")
