"""report.folded_table: the provenance columns of a table folded beneath it, rendered by MyST's own parser.

The reference is the HTML that myst-parser's Markdown parser (the one MyST-NB renders a Markdown output
with, ``nb_render_markdown_format: myst``) makes of the output, read back with ``html.parser``.
"""

from html.parser import HTMLParser

import pytest
from myst_parser.config.main import MdParserConfig
from myst_parser.parsers.mdit import create_md_parser
from markdown_it.renderer import RendererHTML

from bp_mech.book import report

ROWS = [{"candidate": "plain", "peak": "1.00 MiB", "evidence": "cpu-mechanism", "run label": "cpu-default"},
        {"candidate": "checkpoint-all", "peak": "0.75 MiB", "evidence": "cpu-mechanism", "run label": "cpu-default"}]


class Tables(HTMLParser):
    """The tables of a page (header and cells as text), each with whether it sits inside a <details>, and
    the <summary> texts."""

    def __init__(self):
        super().__init__()
        self.tables, self.summaries, self.details, self.paragraphs = [], [], 0, []
        self._cell = self._in = None

    def handle_starttag(self, tag, attrs):
        if tag == "details":
            self.details += 1
        elif tag == "table":
            self.tables.append(dict(folded=self.details > 0, rows=[]))
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th", "summary", "p"):
            self._cell, self._in = "", tag

    def handle_endtag(self, tag):
        if tag == "details":
            self.details -= 1
        elif tag == self._in:
            {"summary": self.summaries, "p": self.paragraphs}.get(tag, self.tables[-1]["rows"][-1] if self.tables
                                                                   else []).append(self._cell)
            self._in = None

    def handle_data(self, data):
        if self._in:
            self._cell += data


def rendered(markdown: str) -> Tables:
    html = create_md_parser(MdParserConfig(), RendererHTML).render(markdown)
    t = Tables()
    t.feed(html)
    return t


def test_the_detail_columns_fold_into_one_sentence_when_every_row_shares_them():
    t = rendered(report.folded_table(ROWS).data)
    [shown] = t.tables
    assert not shown["folded"] and shown["rows"] == [["candidate", "peak"], ["plain", "1.00 MiB"],
                                                     ["checkpoint-all", "0.75 MiB"]]
    assert t.summaries == ["Evidence, run label of these rows"]
    assert t.paragraphs == ["Every row: evidence cpu-mechanism, run label cpu-default."]


def test_differing_details_fold_into_a_table_named_by_the_first_column():
    rows = [dict(ROWS[0]), dict(ROWS[1], **{"run label": "cpu-default-s64"})]
    t = rendered(report.folded_markdown(rows, summary="Where these come from"))
    shown, folded = t.tables
    assert not shown["folded"] and [r[0] for r in shown["rows"]] == ["candidate", "plain", "checkpoint-all"]
    assert folded["folded"] and folded["rows"] == [["candidate", "evidence", "run label"],
                                                   ["plain", "cpu-mechanism", "cpu-default"],
                                                   ["checkpoint-all", "cpu-mechanism", "cpu-default-s64"]]
    assert t.summaries == ["Where these come from"] and t.details == 0  # every <details> closed


def test_columns_key_and_a_column_only_some_rows_have():
    rows = [dict(ROWS[0]), {"candidate": "offload", "failure": "out of memory", "evidence": "cpu-mechanism",
                            "run label": "x"}]
    t = rendered(report.folded_markdown(rows, key="peak"))
    shown, folded = t.tables
    assert shown["rows"][0] == ["candidate", "peak", "failure"]
    assert shown["rows"][2] == ["offload", "–", "out of memory"]
    assert folded["rows"][0] == ["peak", "evidence", "run label"] and folded["rows"][2] == ["–", "cpu-mechanism", "x"]
    t = rendered(report.folded_markdown(rows, columns=["candidate", "run label"]))
    assert [tab["rows"][0] for tab in t.tables] == [["candidate"], ["candidate", "run label"]]


@pytest.mark.parametrize("rows", [[{"a": 1, "b": 2}], [{"evidence": "x", "run label": "y"}]])
def test_without_detail_or_without_anything_else_it_is_the_plain_table(rows):
    assert report.folded_markdown(rows) == report.markdown_table(rows).data
    assert "<details" not in report.folded_markdown(rows)


def test_markdown_table_is_unchanged():
    assert report.markdown_table(ROWS, ["candidate", "evidence"]).data == (
        "| candidate | evidence |\n|---|---|\n| plain | cpu-mechanism |\n| checkpoint-all | cpu-mechanism |")
    assert report.markdown_table([{"a": 1}, {"b": 2}]).data == "| a |\n|---|\n| 1 |\n| – |"  # the first row's keys


def test_a_pipe_in_a_cell_does_not_split_it():
    t = rendered(report.markdown_table([{"a": "|g| < eps", "b": 1}]).data)
    assert t.tables[0]["rows"] == [["a", "b"], ["|g| < eps", "1"]]


def test_the_summary_is_escaped():
    assert "<summary>a &lt;b&gt; &amp; c</summary>" in report.folded_markdown(ROWS, summary="a <b> & c")


def test_a_column_that_is_dash_in_every_row_is_left_out():
    """A failure column where nothing failed says nothing (issue 29: no table half made of "–")."""
    rows = [{"candidate": "plain", "peak": "1 MiB", "failure": "–"}, {"candidate": "offload", "peak": "2 MiB", "failure": "–"}]
    assert "failure" not in report.markdown_table(rows).data
    rows[1]["failure"] = "OOM"
    assert "failure" in report.markdown_table(rows).data
