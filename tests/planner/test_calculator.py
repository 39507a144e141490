"""``planner.calculator``: the book calculator's stored points are ``bp-mech plan``'s, to the byte.

At seeded random offered points, the command itself (``planner.report.run`` with ``--json``, the request
``calculator.request`` makes) is run and its rows (peak, needs) and its pick for a random budget compared
with ``calculator.evaluate`` on the committed records (``book.computations.calculator_table``: refused when
stale). The default run takes the book's small models; the public ones are marked slow (minutes each).
"""

from __future__ import annotations

import json
import os
import random

import pytest

from bp_mech.book import computations
from bp_mech.planner import calculator, report
from bp_mech.planner.shapes import SHAPES

SEED = 2026


def command_json(p: calculator.Point, budget: int, tmp_path, capsys) -> dict:
    """What ``bp-mech plan ... --json`` prints at point ``p`` for ``budget`` bytes."""
    config = None
    if p.model not in calculator.WORKLOADS:  # a public shape: the config.json the command reads
        config = tmp_path / p.model / "config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(SHAPES[p.model]))
    r = calculator.request(p, budget, config and str(config))
    r = type(r)(**{**r.__dict__, "json": True})
    capsys.readouterr()
    report.run(r)
    return json.loads(capsys.readouterr().out)


def check(p: calculator.Point, rng: random.Random, tmp_path, capsys, none_fits: bool = False) -> None:
    """The command at ``p`` for a random budget equals ``evaluate``: rows, fits, pick (``none_fits``: the budget
    may be below every row's needs, where the command also traces what would fit instead)."""
    table = computations.calculator_table(p.model)
    rows = calculator.evaluate({p.model: table}, p, 2**50).rows
    needs = sorted(r.needs for r in rows)
    budget = rng.randint(needs[0] - (2**20 if none_fits else 0), needs[-1] + 2**20)  # where picks change
    got = command_json(p, budget, tmp_path, capsys)
    answer = calculator.evaluate({p.model: table}, p, budget)
    assert [(r.strategy, r.peak, r.needs) for r in answer.rows] == \
        [(r["strategy"], r["peak"], r["needs"]) for r in got["rows"]], p
    assert answer.fits == [r["fits"] for r in got["rows"]]
    assert answer.pick == got["recommended"], (p, budget)


def sample(models, k: int, rng: random.Random, seqs=None) -> list[calculator.Point]:
    pts = [p for m in models for p in calculator.points(m) if seqs is None or p.seq in seqs]
    return rng.sample(pts, k)


def test_tiny_at_random_points_is_the_command(tmp_path, capsys):
    rng = random.Random(SEED)
    for p in sample(["tiny"], 4, rng):
        check(p, rng, tmp_path, capsys, none_fits=True)


def test_qwen05_at_a_random_point_is_the_command(tmp_path, capsys):
    rng = random.Random(SEED + 1)
    for p in sample(["qwen05"], 1, rng, seqs=(512,)):
        check(p, rng, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("BP_MECH_SLOW"), reason="minutes per model: BP_MECH_SLOW=1 runs it")
@pytest.mark.parametrize("model", [m for m in calculator.SPACE if m not in calculator.WORKLOADS])
def test_a_public_model_at_a_random_point_is_the_command(model, tmp_path, capsys):
    rng = random.Random(f"{SEED}-{model}")
    for p in sample([model], 1, rng):
        check(p, rng, tmp_path, capsys)


def test_every_point_has_its_record_and_no_other():
    for m in calculator.SPACE:
        table = computations.calculator_table(m)
        assert [e.point for e in table.entries] == calculator.points(m)
        assert all(e.rows and e.rows[0].strategy == "plain" for e in table.entries)


def test_a_point_not_offered_is_refused():
    with pytest.raises(ValueError, match="not a point the calculator offers"):
        calculator.Point("tiny", "full", 1, 33, 2)
    with pytest.raises(ValueError, match="not a point"):
        calculator.Point("llama-3-70b", "full", 1, 2048, 1)  # one GPU is not offered for the 70B


def test_the_request_is_the_command_line():
    p = calculator.Point("qwen05", "lora", 8, 512, 4)
    r = calculator.request(p, 2**34)
    assert (r.workload, r.batch, r.seq, r.gpus, r.shard) == ("qwen05-b4s512", 4, 512, 8, "fsdp2")
    assert r.weights.value == "bfloat16" and r.finetune.lora_rank == calculator.LORA_RANK
    assert [s.name for s in r.candidates] == list(calculator.STRATEGIES)
    q = calculator.request(calculator.Point("llama-3-70b", "full", 8, 2048, 1), 2**34, "x/config.json")
    assert q.config == "x/config.json" and q.weights is None and q.finetune is None
