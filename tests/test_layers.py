"""The package's import graph (the layout of ``bp_mech/__init__.py``): imports run down the layers, never
up, and no module imports itself back through others. Every ``bp_mech`` import counts, including those
inside functions."""

import ast
import graphlib
from pathlib import Path

import bp_mech

SRC = Path(bp_mech.__file__).parent
# what the mechanisms measure with, and where they find a model's parts (bench.anatomy)
INSTRUMENTS = {"bench.workload", "bench.tracking", "bench.counters", "bench.anatomy"}
# lowest first; a module may import its own layer and the ones before it
LAYERS = ["package", "instruments", "mechanisms", "bench", "records", "experiments", "planner", "projects", "book",
          "checks", "cli"]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def layer(module: str) -> str:
    rest = module.removeprefix("bp_mech").lstrip(".")
    if not rest:
        return "package"
    if rest in INSTRUMENTS:
        return "instruments"
    top = rest.split(".")[0]
    if top in ("cli", "__main__"):
        return "cli"
    return top if top in LAYERS else "mechanisms"


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
    assert layer("bp_mech.bench.workload") == "instruments" and layer("bp_mech.cli") == "cli"
    assert {layer(m) for m in MODULES} == set(LAYERS)


def test_imports_run_down_the_layers():
    up = [f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, targets in GRAPH.items() for t in targets
          if LAYERS.index(layer(t)) > LAYERS.index(layer(m))]
    assert not up, "\n".join(sorted(up))


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
