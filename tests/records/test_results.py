import ast
import dataclasses
import json
import subprocess

import jsonschema
import pytest

from bp_mech.records import provenance, results
from bp_mech.records.registry import make_context
from bp_mech.records.results import FIELDS, Record, RecordError, check_mergeable, load_record, load_records, save_record


def _record(**kw):
    ctx = make_context("TRAIN-LOCAL-BACKWARD", "cpu", "tiny-b1s8")
    return ctx.record(kw.pop("candidate", "linear"), **kw)


def test_schema_covers_exactly_the_record_fields():
    """Every field is a property, in order; a field added after records were cached may be left
    out of ``required`` (so those records still validate) but must then accept null."""
    s = results.schema()
    assert list(s["properties"]) == list(FIELDS) and s["additionalProperties"] is False
    assert [f for f in FIELDS if f in s["required"]] == s["required"]
    for f in set(FIELDS) - set(s["required"]):
        assert not results.schema_errors(s["properties"][f], None), f
    assert "numerics" in FIELDS and not results.schema_errors(s["properties"]["numerics"], {"sdpa_kernel": None})


def test_saved_record_has_every_field_and_validates_against_the_shipped_schema(tmp_path):
    r = _record(output_error=1e-16, grad_error=2e-16, all_finite=True)
    path = save_record(r, tmp_path)
    data = json.loads(path.read_text())
    assert set(data) == set(FIELDS)
    jsonschema.Draft202012Validator(results.schema()).validate(data)
    assert load_record(path) == r
    assert data["evidence_level"] == "cpu-mechanism" and data["code_hash"] and data["created_at"]
    assert data["peak_allocated"] is None  # null where not applicable, never missing
    assert not list(tmp_path.glob(".tmp-*"))  # the atomic write left no temp file


def test_missing_field_is_refused_naming_file_and_field(tmp_path):
    path = save_record(_record(), tmp_path)
    data = json.loads(path.read_text())
    del data["model_commit"]
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"linear\.json.*model_commit"):
        load_record(path)


def test_wrong_type_and_bad_enum_are_refused(tmp_path):
    with pytest.raises(RecordError, match="peak_allocated"):
        results.validate(dataclasses.replace(_record(), peak_allocated=-5).to_dict())
    with pytest.raises(RecordError, match="decision"):
        results.validate(dataclasses.replace(_record(), decision="maybe").to_dict())
    with pytest.raises(RecordError):  # gpu-measured without device and CUDA
        results.validate(dataclasses.replace(_record(), evidence_level="gpu-measured", memory_source=None).to_dict())


def test_truncated_and_corrupt_records_are_refused_naming_the_file(tmp_path):
    path = save_record(_record(), tmp_path)
    path.write_text(path.read_text()[:100])
    with pytest.raises(RecordError, match="not valid JSON") as e:
        load_record(path)
    assert path.name in str(e.value)
    path.write_text("[1, 2]")
    with pytest.raises(RecordError, match="JSON object"):
        load_record(path)


def test_records_of_different_commits_or_workloads_never_merge(tmp_path):
    a = save_record(_record(candidate="linear"), tmp_path)
    b = save_record(dataclasses.replace(_record(candidate="silu"), model_commit="config-other"), tmp_path)
    items = load_records(tmp_path)
    with pytest.raises(RecordError, match=r"silu\.json.*model_commit"):
        check_mergeable(items)
    c = dataclasses.replace(_record(candidate="gelu"), workload_id="tiny-b2s8")
    with pytest.raises(RecordError, match="workload_id"):
        check_mergeable([(a, load_record(a)), (tmp_path / c.filename, c)])
    check_mergeable([(a, load_record(a))])
    assert b.exists()


def test_stale_code_hash_is_detected():
    r = _record()
    assert not provenance.is_stale(r, "bp_mech.experiments.local_backward")
    assert provenance.is_stale(dataclasses.replace(r, code_hash="0" * 16), "bp_mech.experiments.local_backward")


def test_record_filename_is_one_file_per_candidate_and_run():
    r = _record()
    assert r.filename == "TRAIN-LOCAL-BACKWARD__tiny-b1s8__cpu-default__linear.json"
    assert isinstance(r, Record)


def test_every_cached_record_in_the_book_validates_and_merges():
    from bp_mech import RESULTS_DIR
    from bp_mech.records.cache import cached
    from bp_mech.records.registry import EXPERIMENTS

    items = load_records(RESULTS_DIR)  # raises RecordError naming the first invalid file
    for sid in {r.semantic_id for _, r in items}:
        assert sid in EXPERIMENTS
        cached(sid)  # refuses mixed workloads / commits within a run label


@pytest.mark.parametrize("change", [
    {}, {"peak_allocated": -5}, {"decision": "maybe"}, {"input_shape": [2, "x"]}, {"seed": True},
    {"evidence_level": "gpu-measured"}, {"semantic_id": "LOCAL"}, {"transfer_bytes": {"d2h": 1}},
    {"memory_source": "tracked-cpu", "evidence_level": "estimated"}, {"extra_field": 1}, {"run_label": ""},
])
def test_builtin_validator_agrees_with_jsonschema(change):
    """The GPU machine may lack jsonschema; the fallback must accept and refuse the same records."""
    data = dict(_record().to_dict(), **change)
    ours = results.schema_errors(results.schema(), data)
    theirs = list(jsonschema.Draft202012Validator(results.schema()).iter_errors(data))
    assert bool(ours) == bool(theirs), (ours, [e.message for e in theirs])
    data.pop("model_commit")
    assert results.schema_errors(results.schema(), data)


# --- updates ---------------------------------------------------------------------------

def test_updates_is_null_unless_the_experiment_says_how_many_ran():
    assert _record().updates is None and _record(updates=3).updates == 3


# --- staleness: code_hash covers the code that determines the numbers -------------------

def _edited(monkeypatch, name: str, edit):
    """Make ``module_source(name)`` return ``edit(real source)``; the real files stay untouched."""
    real = provenance.module_source
    monkeypatch.setattr(provenance, "module_source", lambda n: edit(real(n)) if n == name else real(n))


def _replace_once(old: str, new: str):
    def edit(src: str) -> str:
        assert src.count(old) == 1, old
        return src.replace(old, new)
    return edit


def test_code_modules_follow_imports_and_skip_presentation():
    amp = provenance.code_modules("bp_mech.experiments.amp")
    assert {"bp_mech.experiments.amp", "bp_mech.amp", "bp_mech.scheduler", "bp_mech.bench.timing", "bp_mech.instruments.workload"} <= set(amp)
    assert not set(amp) & {"bp_mech.records.results", "bp_mech.records.registry", "bp_mech.records.environment", "bp_mech.book.report"}
    assert "bp_mech.instruments.workload" in provenance.code_modules("bp_mech.experiments.local_backward")
    assert "bp_mech.experiments.harness" in provenance.code_modules("bp_mech.experiments.checkpointing")  # from bp_mech.x import y
    assert "bp_mech.book.report" not in provenance.code_modules("bp_mech.experiments.ledger")  # imported, but presentation only
    assert "bp_mech.bench.timing" not in provenance.code_modules("bp_mech.scheduler")


def test_code_modules_keeps_explicit_code_modules(monkeypatch):
    assert "bp_mech.planner.lifecycle" not in provenance.code_modules("bp_mech.scheduler")
    _edited(monkeypatch, "bp_mech.scheduler", lambda s: s + '\nCODE_MODULES = ("bp_mech.planner.lifecycle",)\n')
    assert "bp_mech.planner.lifecycle" in provenance.code_modules("bp_mech.scheduler")


def _docstrings_and_comments_changed(src: str) -> str:
    tree = ast.parse(src)
    doc = ast.get_docstring(tree, clean=False)
    assert doc
    out = src.replace(doc, doc + "\n\nA sentence added to the module docstring.\n", 1)
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and ast.get_docstring(n, clean=False))
    fdoc = ast.get_docstring(func, clean=False)
    out = out.replace(fdoc, fdoc.rstrip() + " Reworded.", 1)
    out = "# a new comment at the top\n\n" + out.replace("\n\n\n", "\n\n\n# a comment between definitions\n", 1)
    new_tree = ast.parse(out)  # the edit took: both docstrings differ, the lines moved
    new_func = next(n for n in new_tree.body if isinstance(n, ast.FunctionDef) and n.name == func.name)
    assert ast.get_docstring(new_tree, clean=False) != doc and ast.get_docstring(new_func, clean=False) != fdoc
    assert new_func.lineno != func.lineno
    return out


@pytest.mark.parametrize("experiment, dependency", [
    ("bp_mech.experiments.amp", "bp_mech.scheduler"), ("bp_mech.experiments.amp", "bp_mech.bench.timing"),
    ("bp_mech.experiments.amp", "bp_mech.amp"),
    ("bp_mech.experiments.attention_backward", "bp_mech.bench.timing"),
    ("bp_mech.experiments.checkpointing", "bp_mech.experiments.harness"),
])
def test_docstring_and_comment_edits_keep_the_hash(monkeypatch, experiment, dependency):
    before, source = provenance.code_hash(experiment), provenance.module_source(dependency)
    _edited(monkeypatch, dependency, _docstrings_and_comments_changed)
    assert provenance.module_source(dependency) != source and provenance.code_hash(experiment) == before


@pytest.mark.parametrize("experiment, dependency, old, new", [
    ("bp_mech.experiments.amp", "bp_mech.scheduler", "self.updates += 1", "self.updates += 2"),
    ("bp_mech.experiments.amp", "bp_mech.bench.timing", "def percentile(", "def percentile_(xs):\n    return xs\n\n\ndef percentile("),
    ("bp_mech.experiments.attention_backward", "bp_mech.bench.timing", "def percentile(", "def percentile_(xs):\n    return xs\n\n\n"
                                                                      "def percentile("),
    ("bp_mech.experiments.update_dynamics", "bp_mech.bench.timing", "def percentile(", "def percentile_(xs):\n    return xs\n\n\n"
                                                                   "def percentile("),
    ("bp_mech.experiments.local_backward", "bp_mech.instruments.workload", "PAD_ID = 0", "PAD_ID = 1"),
])
def test_a_code_change_in_a_dependency_changes_the_hash(monkeypatch, experiment, dependency, old, new):
    before = provenance.code_hash(experiment)
    _edited(monkeypatch, dependency, _replace_once(old, new))
    assert provenance.code_hash(experiment) != before


@pytest.mark.parametrize("experiment, unrelated", [
    ("bp_mech.experiments.amp", "bp_mech.attention_backward"), ("bp_mech.experiments.amp", "bp_mech.records.environment"), ("bp_mech.experiments.ledger", "bp_mech.book.report"),
    ("bp_mech.local_backward", "bp_mech.bench.timing"), ("bp_mech.experiments.scheduler", "bp_mech.records.registry"),
])
def test_a_change_in_an_unrelated_module_keeps_the_hash(monkeypatch, experiment, unrelated):
    before = provenance.code_hash(experiment)
    _edited(monkeypatch, unrelated, lambda s: s + "\n\ndef _added_function():\n    return 42\n")
    assert provenance.code_hash(experiment) == before


def test_canonical_form_has_no_positions_docstrings_or_empty_fields():
    """The exact text: fields sorted, empty ones (``type_params`` on 3.12+, ``type_comment``) dropped,
    so Python 3.10 to 3.13 give the same hash; blank lines and docstrings do not reach it."""
    a = provenance.canonical(ast.parse('def f(a, *, b=None):\n    """doc"""\n    return a + 1.5'))
    b = provenance.canonical(ast.parse('\n\n# comment\ndef f(a, *, b=None):\n    return a + 1.5  # why'))
    assert a == b == ("Module(body=[FunctionDef(args=arguments(args=[arg(arg=str:'a')],kw_defaults=[Constant()],"
                      "kwonlyargs=[arg(arg=str:'b')]),body=[Return(value=BinOp(left=Name(ctx=Load(),id=str:'a'),"
                      "op=Add(),right=Constant(value=float:1.5)))],name=str:'f')])")
    assert provenance.canonical(ast.parse("x = 1")) != provenance.canonical(ast.parse("x = 1.0"))
    assert provenance.canonical(ast.parse("x = 'a'")) != provenance.canonical(ast.parse("x = 'b'"))  # strings in code count


# --- git commit --------------------------------------------------------------------------

@pytest.fixture
def fresh_git_commit():
    provenance.git_commit.cache_clear()
    yield provenance.git_commit
    provenance.git_commit.cache_clear()


def test_git_commit_falls_back_to_the_environment_without_git(fresh_git_commit, monkeypatch):
    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, "abc123")
    assert fresh_git_commit() == "abc123"
    fresh_git_commit.cache_clear()
    monkeypatch.delenv(provenance.GIT_COMMIT_ENV)
    assert fresh_git_commit() is None


def test_git_commit_ignores_a_repository_around_a_copied_tree(fresh_git_commit, monkeypatch, tmp_path):
    """A .git above the tree's root (the tree copied into some other checkout) is not this code's history."""
    monkeypatch.setattr(provenance.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, f"{tmp_path}\n{'f' * 40}\n", ""))
    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, "from-the-suite-script")
    assert fresh_git_commit() == "from-the-suite-script"


def test_git_commit_reads_this_checkout(fresh_git_commit):
    from bp_mech import ROOT as root
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    assert fresh_git_commit() == head and len(head) == 40


def test_the_computed_records_folder_is_not_read_as_run_records(tmp_path):
    """``book/results/computed/`` holds computed records (another schema) beside the run records."""
    path = save_record(_record(), tmp_path)
    (tmp_path / "computed").mkdir()
    (tmp_path / "computed" / "sweep.json").write_text('{"name": "sweep"}')
    assert [p for p, _ in load_records(tmp_path)] == [path]
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "bad.json").write_text('{"name": "sweep"}')
    with pytest.raises(RecordError, match="bad.json"):
        load_records(tmp_path)  # any other folder is still read


def test_one_experiments_records_are_validated_and_others_only_read(tmp_path):
    """``load_records(d, sid)`` validates the records of ``sid``: a bad record of another experiment is read,
    not validated (it is refused where its own are loaded, or all are); one of ``sid`` is refused."""
    path = save_record(_record(), tmp_path)
    sid = _record().semantic_id
    bad = dict(_record().to_dict(), semantic_id="TRAIN-OTHER", evidence_level="rumour")
    (tmp_path / "other.json").write_text(json.dumps(bad))
    assert [p for p, _ in load_records(tmp_path, sid)] == [path]
    with pytest.raises(RecordError, match="other.json"):
        load_records(tmp_path, "TRAIN-OTHER")
    with pytest.raises(RecordError, match="other.json"):
        load_records(tmp_path)
    (tmp_path / "cut.json").write_text('{"semantic_id": ')  # unreadable: whose it is cannot be known
    with pytest.raises(RecordError, match="cut.json"):
        load_records(tmp_path, sid)
    (tmp_path / "cut.json").write_text(json.dumps(dict(_record().to_dict(), evidence_level="rumour")))
    with pytest.raises(RecordError, match="cut.json"):
        load_records(tmp_path, sid)
