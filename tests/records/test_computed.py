"""Computed records (``records.computed``): a value round-trips through its JSON into the same types; a record
computed by other code, versions, arguments or inputs is refused, naming itself and the remedy; and every
committed record is current for the code as it is (the strict build never traces what a record holds)."""

import json
import typing

import pytest

from bp_mech.planner.reference_gap import Case, Gap, reference_gap
from bp_mech.records import computed, provenance
from bp_mech.records.computed import COMPUTED_DIR, REFRESH_ENV, StaleRecord

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
    typed = computed.decode(dict[int, tuple[float, ...]], json.loads(json.dumps(computed.encode({3: (1.0, -1e999)}))))
    assert list(typed) == [3] and typed[3] == (1.0, float("-inf"))


def _traced(case_workload: str = "tiny-b2s32", definitions=("a", "c")) -> Gap:
    return reference_gap("TRAIN-CHECKPOINT", list(definitions), workers=1,
                         case=Case("TRAIN-CHECKPOINT", case_workload, ("checkpoint-all",)))


def test_a_refreshed_record_is_read_back_without_tracing_again(tmp_path, monkeypatch):
    monkeypatch.setenv(REFRESH_ENV, "refresh")
    made = computed.cached("gap", _traced, directory=tmp_path)
    monkeypatch.delenv(REFRESH_ENV)
    monkeypatch.setattr("bp_mech.planner.reference_gap.lifecycle.Session", None)  # a trace would fail now
    assert computed.cached("gap", _traced, directory=tmp_path) == made
    assert isinstance(made, Gap) and made.rows[0].plain_peak > 0


def test_a_missing_record_is_refused_with_how_to_make_it(tmp_path):
    with pytest.raises(StaleRecord, match=r"no computed record 'gap'.*make records"):
        computed.cached("gap", _traced, directory=tmp_path)


@pytest.mark.parametrize("field", ["code_hash", "versions", "arguments", "inputs"])
def test_a_record_from_other_code_versions_arguments_or_inputs_is_refused(tmp_path, monkeypatch, field):
    source = tmp_path / "input.txt"
    source.write_text("one")
    monkeypatch.setenv(REFRESH_ENV, "refresh")
    computed.cached("gap", _traced, inputs=[source], directory=tmp_path)
    monkeypatch.delenv(REFRESH_ENV)
    args = ()
    if field == "inputs":
        source.write_text("two")  # an input changed after the record was made
    elif field == "arguments":
        args = ("tiny-b2s32", ("a",))  # the page now asks for something else
    else:
        p = computed.path("gap", tmp_path)
        doc = json.loads(p.read_text())
        doc[field] = "older" if field == "code_hash" else {"torch": "0.0", "transformers": "0.0"}
        p.write_text(json.dumps(doc))
    with pytest.raises(StaleRecord, match=rf"gap.json: stale computed record \({field} changed.*make records"):
        computed.cached("gap", _traced, *args, inputs=[source], directory=tmp_path)


def test_workers_do_not_key_a_record():
    assert computed.key(_traced, (), {"workers": 1}) == computed.key(_traced, (), {"workers": 4})


COMMITTED = sorted(COMPUTED_DIR.glob("*.json"))


@pytest.mark.parametrize("p", COMMITTED, ids=[p.stem for p in COMMITTED])
def test_every_committed_record_is_current(p):
    """Its code (the computing function's module and imports) and library versions are today's; a page's
    build checks its arguments and inputs too. Refreshed by ``make records``."""
    doc = json.loads(p.read_text())
    now = {"code_hash": provenance.code_hash(doc["module"]), "versions": computed.versions()}
    assert computed.stale_fields(doc, now) == [], f"{p.name}: run `make records`"


def test_the_pages_records_are_committed():
    names = {p.stem for p in COMMITTED}
    assert {f"reference-gap__{s}" for s in ("TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-AMP-BACKWARD",
                                            "TRAIN-GRADIENT-ACCUMULATION")} | {"sweep"} <= names
    assert typing.get_type_hints(computed.cached)  # (the module's annotations resolve)
