"""``records.provenance``: which modules a record's code hash covers (followed through the imports, less
what only stores or shows results) and that only a code change in one of them changes it, shown by handing
it edited sources. The canonical tree and the git commit: ``tests/records/test_results.py``."""

import pytest

from bp_mech.records import provenance

EXP = "bp_mech.experiments.checkpointing"


def test_the_hash_covers_the_experiment_and_what_it_imports_transitively():
    mods = provenance.code_modules(EXP)
    assert EXP in mods and "bp_mech.experiments.harness" in mods  # imported by the experiment
    assert "bp_mech.bench.step" in mods and "bp_mech.instruments.tracking" in mods  # and by what it imports
    assert not set(mods) & (provenance.NOT_HASHED - {EXP})  # storing and showing results decides no number
    assert mods == sorted(mods)


def _edited(monkeypatch, name, edit):
    real = provenance.module_source
    monkeypatch.setattr(provenance, "module_source", lambda n: edit(real(n)) if n == name else real(n))


@pytest.mark.parametrize("edit, changes", [
    (lambda s: s.replace('"""', '"""An added sentence. ', 1), False),  # the module docstring
    (lambda s: s + "\n# a comment at the end\n", False),
    (lambda s: s + "\nEXTRA = 1\n", True),  # code
])
def test_only_a_code_change_in_a_covered_module_changes_the_hash(monkeypatch, edit, changes):
    before = provenance.code_hash(EXP)
    _edited(monkeypatch, "bp_mech.bench.timing", edit)  # a module the experiment reaches through the harness
    assert (provenance.code_hash(EXP) != before) is changes


def test_a_change_in_a_module_it_does_not_reach_leaves_the_hash(monkeypatch):
    assert "bp_mech.book.plots" not in provenance.code_modules(EXP)
    before = provenance.code_hash(EXP)
    _edited(monkeypatch, "bp_mech.book.plots", lambda s: s + "\nEXTRA = 1\n")
    assert provenance.code_hash(EXP) == before


def test_the_provenance_fields():
    p = provenance.provenance(EXP)
    assert set(p) == {"created_at", "bp_mech_version", "code_hash", "git_commit"}
    assert p["code_hash"] == provenance.code_hash(EXP) and len(p["code_hash"]) == 16 and "+00:00" in p["created_at"]
