"""``book.calculator_page``: the calculator's data, and the page in headless Chromium against ``evaluate``.

The browser tests set seeded random offered points and budgets through the form (Selenium's select and
keys, as a reader would) and compare each row's peak and needs, whether it fits, and the pick with
``planner.calculator.evaluate`` on the same records (tests/planner/test_calculator.py checks those against
``bp-mech plan`` itself): first on the calculator alone (``form_html`` in a bare page), then on the built
book's page (tools/book_build.py's build of the current sources, as tests/test_browser.py reads it).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest

from bp_mech.book import calculator_page, computations
from bp_mech.planner import calculator

GiB = 2**30
PAGE = "book/appendix/memory-calculator.html"
SEED = 77


@pytest.fixture(scope="module")
def tables() -> dict:
    return {m: computations.calculator_table(m) for m in calculator.SPACE}


def test_the_data_holds_every_point_and_exact_bytes(tables):
    data = calculator_page.page_data(tables)
    assert len(data["points"]) == sum(len(calculator.points(m)) for m in calculator.SPACE)
    row = data["points"]["tiny|full|1|32|1"][0]
    first = tables["tiny"].entries[0].rows[0]
    assert row == [first.strategy, first.peak, first.needs, first.extra, first.keeps_float32, first.mechanisms]
    assert all(isinstance(v, int) and v < 2**53 for rows in data["points"].values() for r in rows for v in r[1:3])
    # it opens where the budget decides: the pick at 80 GiB is not plain, and the peaks differ
    assert data["start"] == calculator_page.key(calculator_page.START)
    start = calculator.evaluate(tables, calculator_page.START, 80 * GiB)
    assert start.pick not in (None, "plain") and len({r.peak for r in start.rows}) > 2, start


def test_bytes_a_javascript_number_cannot_hold_are_refused(tables):
    t = tables["tiny"]
    e = t.entries[0]
    big = calculator.Table(t.model, t.label, [calculator.Entry(e.point, [
        calculator.Row("plain", 2**53, 2**53 + 2, 0.0, True, 0)])])
    with pytest.raises(ValueError, match="not exact in JavaScript"):
        calculator_page.page_data({"tiny": big})


def test_the_html_embeds_the_data_and_the_script(tables):
    html = calculator_page.form_html(tables)
    data = re.search(r'<script type="application/json" id="bp-calc-data">(.*?)</script>', html, re.S).group(1)
    assert json.loads(data) == json.loads(json.dumps(calculator_page.page_data(tables)))
    assert "function recommend(rows, budget)" in html and "</script" not in data


# --- the page in Chromium ------------------------------------------------------------------------

def _browser(tmp_path_factory):
    from browser_pages import browser_missing, chrome

    if reason := browser_missing():
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    return chrome(tmp_path_factory.mktemp("chromium-profile"))


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with _browser(tmp_path_factory) as d:
        yield d


def drive(driver, url: str, tables: dict, n: int, seed: int, shot: Path | None = None) -> int:
    """Set ``n`` random offered points and budgets through the form at ``url``; assert the page shows what
    ``evaluate`` gives. Returns how many rows were compared."""
    from browser_pages import load, screenshot
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    load(driver, url)
    errors = [e["message"] for e in driver.get_log("browser")
              if e["level"] == "SEVERE" and "favicon" not in e["message"]]
    assert not errors, errors
    form = driver.find_element(By.ID, "bp-calc-form")
    opened = driver.execute_script("const out = document.getElementById('bp-calc-pick'); return [out.dataset.point, "
                                   "out.dataset.pick, document.querySelectorAll('#bp-calc-table tbody tr').length];")
    start = calculator.evaluate(tables, calculator_page.START, 80 * GiB)  # the page opens at START, 80 GiB
    assert opened == [calculator_page.key(calculator_page.START), start.pick or "", len(start.rows)], opened
    rng, compared = random.Random(seed), 0
    every = [p for m in tables for p in calculator.points(m)]
    for p in rng.sample(every, n):
        needs = [r.needs for r in calculator.evaluate(tables, p, 0).rows]
        gib = rng.randint(max(1, min(needs) // GiB - 1), max(needs) // GiB + 2)
        for name, value in (("model", p.model), ("mode", p.mode), ("gpus", p.gpus), ("seq", p.seq),
                            ("batch", p.batch)):
            Select(form.find_element(By.NAME, name)).select_by_value(str(value))
        budget = form.find_element(By.NAME, "budget")
        budget.clear()
        budget.send_keys(str(gib))
        shown = driver.execute_script("""
            const rows = [...document.querySelectorAll('#bp-calc-table tbody tr')].map(tr =>
              [tr.dataset.strategy, tr.dataset.peak, tr.dataset.needs, tr.dataset.fits]);
            const out = document.getElementById('bp-calc-pick');
            return {rows, pick: out.dataset.pick, point: out.dataset.point, budget: out.dataset.budget,
                    said: out.textContent, cmd: document.getElementById('bp-calc-cmd').textContent,
                    absent: document.getElementById('bp-calc-absent').textContent};""")
        answer = calculator.evaluate(tables, p, gib * GiB)
        assert (shown["point"], int(shown["budget"])) == (calculator_page.key(p), gib * GiB), (shown, p, gib)
        assert shown["rows"] == [[r.strategy, str(r.peak), str(r.needs), str(f).lower()]
                                 for r, f in zip(answer.rows, answer.fits)], p
        assert (shown["pick"] or None) == answer.pick, (p, gib)
        assert shown["said"] == (f"The plan's pick for {gib} GiB per GPU: {answer.pick}." if answer.pick
                                 else "Nothing fits this budget."), shown["said"]
        assert f"--budget {gib}GiB" in shown["cmd"] and f"{p.batch}" in shown["cmd"]
        absent = [n for n in calculator.STRATEGIES if n not in {r.strategy for r in answer.rows}]
        assert all(n in shown["absent"] for n in absent) and bool(absent) == bool(shown["absent"])
        compared += len(answer.rows)
    if shot:
        screenshot(driver, shot)
    return compared


@pytest.mark.browser
def test_the_calculator_in_chromium_is_the_evaluator(driver, tables, tmp_path):
    from browser_pages import serve

    (tmp_path / "calc.html").write_text("<!doctype html><html><head><meta charset='utf-8'></head><body>"
                                        + calculator_page.form_html(tables) + "</body></html>", encoding="utf-8")
    with serve(tmp_path) as url:
        assert drive(driver, url + "calc.html", tables, 40, SEED, tmp_path / "calc.png") > 40
        # the script's rule at every point, at each row's needs and a byte below it: where a pick can change
        asked = [(calculator_page.key(e.point), b) for t in tables.values() for e in t.entries
                 for r in e.rows for b in (r.needs, r.needs - 1)]
        picks = driver.execute_script("return arguments[0].map(([k, b]) => window.bpCalcPick(k, b));", asked)
        want = [calculator.evaluate(tables, e.point, b).pick for t in tables.values() for e in t.entries
                for r in e.rows for b in (r.needs, r.needs - 1)]
        assert picks == want


@pytest.mark.browser
def test_the_built_page_is_the_evaluator(driver, tables, tmp_path):
    import book_build
    from browser_pages import serve

    html = os.environ.get("BP_MECH_BOOK_HTML")
    if html is None:
        build = book_build.current_build()  # `make book`'s or tests/test_book.py's, when of these sources
        if not build.clean:
            pytest.fail("the book's build failed (tests/test_book.py::test_strict_book_build):\n" + build.log[-4000:])
        html = build.html
    with serve(Path(html)) as url:
        drive(driver, url + PAGE, tables, 12, SEED + 1, tmp_path / "page.png")
