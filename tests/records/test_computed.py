"""Computed records (``records.computed``, ``book.computations``): a value round-trips through its JSON into
the same types; a record computed by other code, versions or inputs is refused, naming itself; and every
record the pages read is present and current (the strict build never traces what a record holds)."""

import json
import typing

import pytest

from bp_mech.book import computations
from bp_mech.planner.reference_gap import Case, Gap, reference_gap
from bp_mech.records import computed
from bp_mech.records.computed import Computation, StaleRecord

TINY = Case("TRAIN-CHECKPOINT", "tiny-b2s32", ("checkpoint-all",))


@pytest.fixture(scope="module")
def gap() -> Gap:
    return reference_gap("TRAIN-CHECKPOINT", ["a", "c"], workers=1, case=TINY)


def test_a_gap_round_trips_into_the_same_types(gap):
    back = computed.decode(Gap, json.loads(json.dumps(computed.encode(gap))))
    assert back == gap
    assert isinstance(back.case.strategies, tuple) and isinstance(back.rows, list)
    assert isinstance(back.verdict.reproduced_by, tuple) and back.rows[0].plain_peak == gap.rows[0].plain_peak


def test_non_finite_floats_and_int_keys_survive():
    value = {"x": float("nan"), "y": (1.0, float("-inf"))}
    back = computed.decode(dict[str, object], json.loads(json.dumps(computed.encode(value))))
    assert back["y"] == ["1.0", "-inf"] or back["y"] == [1.0, "-inf"]  # (untyped: kept as written)
    typed = computed.decode(dict[int, tuple[float, ...]], {"3": [1.0, "-inf"]})
    assert list(typed) == [3] and typed[3][1] == float("-inf")


def _computation(gap, tmp_path, module="bp_mech.planner.reference_gap", inputs=()):
    return Computation("gap", module, lambda: gap, Gap, inputs)


def test_load_gives_back_what_refresh_saved(gap, tmp_path):
    c = _computation(gap, tmp_path)
    computed.refresh(c, tmp_path)
    assert computed.load(c, tmp_path) == gap


def test_a_missing_record_is_refused_with_how_to_make_it(gap, tmp_path):
    with pytest.raises(StaleRecord, match=r"no computed record 'gap'.*make records"):
        computed.load(_computation(gap, tmp_path), tmp_path)


@pytest.mark.parametrize("field", ["code_hash", "versions", "inputs"])
def test_a_record_from_other_code_versions_or_inputs_is_refused(gap, tmp_path, field):
    c = _computation(gap, tmp_path, inputs=(tmp_path / "input.txt",))
    (tmp_path / "input.txt").write_text("one")
    computed.refresh(c, tmp_path)
    p = computed.path(c, tmp_path)
    if field == "inputs":
        (tmp_path / "input.txt").write_text("two")  # an input changed after the record was made
    else:
        doc = json.loads(p.read_text())
        doc[field] = "older" if field == "code_hash" else {"torch": "0.0", "transformers": "0.0"}
        p.write_text(json.dumps(doc))
    with pytest.raises(StaleRecord, match=rf"gap.json: stale computed record \({field} changed"):
        computed.load(c, tmp_path)


def test_the_code_hash_covers_the_computing_module_and_its_imports():
    mods = computed.provenance.code_modules(computations.REFERENCE_GAP)
    assert "bp_mech.planner.lifecycle" in mods and "bp_mech.bench.step" in mods


@pytest.mark.parametrize("name", list(computations.COMPUTATIONS))
def test_every_record_the_pages_read_is_present_and_current(name):
    """Refreshed by ``make records`` after a change to the code it hashes (its message says so)."""
    value, tp = computations.value(name), computations.COMPUTATIONS[name].type
    assert isinstance(value, typing.get_origin(tp) or tp)


def test_the_command_refuses_an_unknown_name(capsys):
    assert computations.main(["no-such-record"]) == 2
    assert "unknown computed record 'no-such-record'" in capsys.readouterr().err
