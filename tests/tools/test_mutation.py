"""The mutation report (``tools/mutation_report.json``, written by ``make mutation``) against the tree.

The report names every file it mutated by SHA-256: when graded code changes, its score no longer describes it,
and the test says to rerun ``make mutation``. Its counts must add up, each equivalent mutant must still be listed
(with a reason) in ``tools/mutation_equivalent.toml``, and CONTRIBUTING.md's "Mutation score" table must be the
one the report renders. The tool's own pieces (what is graded, how a mutant is named) are tested on small sources.
"""

import ast
import json

import pytest

import mutation
import mutation_run
import mutation_spans

REPORT = json.loads(mutation.REPORT.read_text(encoding="utf-8"))
MEASURED = {m: c for m, c in REPORT["chapters"].items() if "score" in c}


def test_some_chapter_was_measured():
    assert MEASURED, "tools/mutation_report.json measures no chapter: run `make mutation`"


@pytest.mark.parametrize("marker", sorted(MEASURED))
def test_graded_code_unchanged_since_the_report(marker):
    changed = [rel for rel, digest in MEASURED[marker]["files"].items()
               if not (mutation.ROOT / rel).exists() or mutation.sha256(mutation.ROOT / rel) != digest]
    assert not changed, (f"{marker}: graded code changed since tools/mutation_report.json was written: {changed}; "
                         f"rerun `make mutation` (or `.venv/bin/python tools/mutation.py {marker}`)")


@pytest.mark.parametrize("marker", sorted(MEASURED))
def test_report_arithmetic(marker):
    c = MEASURED[marker]
    assert c["generated"] == c["killed"] + c["timed_out"] + c["survived"] + c["equivalent"]
    assert c["survived"] == len(c["survivors"]) and c["equivalent"] == len(c["equivalents"])
    judged = c["generated"] - c["equivalent"]
    assert c["score"] == (round((c["killed"] + c["timed_out"]) / judged, 4) if judged else 1.0)
    assert len(set(c["survivors"]) | {e["mutant"] for e in c["equivalents"]}) == c["survived"] + c["equivalent"]


def test_equivalent_mutants_are_still_listed_with_a_reason():
    listed = mutation.load_equivalent()
    assert all(reason.strip() for reason in listed.values())
    for marker, c in MEASURED.items():
        for e in c["equivalents"]:
            assert listed.get(e["mutant"]) == e["reason"], f"{marker}: {e['mutant']} left the equivalent list"


def test_contributing_table_is_the_reports():
    text = mutation.CONTRIBUTING.read_text(encoding="utf-8")
    table = text.split(mutation.BEGIN, 1)[1].split(mutation.END, 1)[0].strip()
    assert table == mutation.render_table(REPORT), "CONTRIBUTING.md's mutation table differs: rerun `make mutation`"


def test_graded_names_are_the_stubs(tmp_path):
    f = tmp_path / "ex.py"
    f.write_text("class Given:\n    x: int = 1\n\n"
                 "class Todo:\n    def step(self):\n        raise NotImplementedError('ex')\n\n"
                 "def f(a):\n    raise NotImplementedError\n\n"
                 "def _helper():\n    raise NotImplementedError\n")
    assert mutation_spans.graded_names(f) == ["Todo", "f"]


def test_a_mutant_is_named_by_its_definition_and_lines():
    tree = ast.parse("class C:\n    def step(self, n):\n        return n + 1\n\ndef g():\n    pass\n")
    assert mutation_run.qualname(tree, 3) == "C.step" and mutation_run.qualname(tree, 6) == "g"
    diff = "--- a/x.py\n+++ b/x.py\n@@ -3 +3 @@\n-        return n + 1\n+        return n - 1"
    assert mutation_run.describe("x.py", "C.step", diff) == "x.py::C.step: `return n + 1` -> `return n - 1`"


def test_helpers_follow_calls_and_self_methods():
    tree = ast.parse("def f():\n    return _a()\n\ndef _a():\n    return b\n\ndef b():\n    pass\n\n"
                     "def unused():\n    pass\n\n"
                     "class C:\n    def step(self):\n        return self._apply()\n\n"
                     "    def _apply(self):\n        return f()\n\n    def extra(self):\n        pass\n")
    defs = mutation_spans._defs(tree)
    assert sorted(mutation_spans._with_helpers(["f"], defs)) == ["_a", "b", "f"]
    assert sorted(mutation_spans._with_helpers(["C.step"], defs)) == ["C._apply", "C.step", "_a", "b", "f"]


def test_postponed_annotations_are_not_graded():
    src = "from __future__ import annotations\n\ndef f(a: int | None) -> str | None:\n    return a | 1\n"
    notes = mutation_spans.annotations(ast.parse(src))
    spans = [("f", 3, 4)]
    assert not mutation_spans.graded(spans, notes, (3, 13)) and not mutation_spans.graded(spans, notes, (3, 28))
    assert mutation_spans.graded(spans, notes, (4, 13)) and not mutation_spans.graded(spans, notes, (5, 0))
    assert mutation_spans.annotations(ast.parse(src.split("\n", 1)[1])) == []  # evaluated: a mutant there can fail


def test_an_ungraded_statement_is_left_out_whole_and_a_stale_entry_stops_the_run(tmp_path):
    (tmp_path / "m.py").write_text("def f(a, half=False):\n    if half:\n        return (a +\n                1)\n"
                                   "    return a * 2\n")
    row = {"exercise": "ex", "file": "m.py", "definition": "f", "statement": "return a + 1", "reason": "an extension"}
    notes = mutation_spans.skipped(tmp_path, ["m.py"], [row])["m.py"]
    spans = [("f", 1, 5)]
    assert [mutation_spans.graded(spans, notes, (line, 8)) for line in range(1, 6)] == [True, True, False, False, True]
    with pytest.raises(SystemExit, match=r"'return a \+ 2': 0 statements of m.py::f, expected one"):
        mutation_spans.skipped(tmp_path, ["m.py"], [row | {"statement": "return a + 2"}])


def test_every_ungraded_entry_names_one_statement_of_graded_code_with_a_reason():
    rows = mutation.listed("ungraded")
    assert all(r["reason"].strip() for r in rows)
    for marker, c in MEASURED.items():
        mine = [r for r in rows if r["exercise"] == c["exercise"]]
        assert c.get("ungraded", []) == mine, f"{marker}: the [[ungraded]] list changed since the report: rerun it"
        mutation_spans.skipped(mutation.ROOT, {r["file"] for r in mine}, mine)  # exactly one statement each
