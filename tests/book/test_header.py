"""The chapter header line, computed by the book's Sphinx extension (book/_ext/bp_book.py) from the
registry: ``{experiment-header} ID`` and ``{evidence}`ID``` say what ``registry.status`` says about
the records, on every build, also when the page did not change and its notebook comes from the
execution cache.

A small MyST-NB project in tmp_path (one chapter with a code cell, one page without the directive)
is built in-process five times with the same sources, while its records folder changes: the cached
CPU records (made current), the same made stale, none, and a synthetic GPU record beside them,
current and then stale (made as tests/book/test_report.py makes it: no GPU record is cached in the
repository). Only the chapter is read again, and its notebook runs once.
"""

from __future__ import annotations

import dataclasses
import html
import io
import re
import shutil
from pathlib import Path

import pytest

from bp_mech import RESULTS_DIR, ROOT
from bp_mech.records import provenance, registry, results

GPU_ID, CPU_ID = "TRAIN-CHECKPOINT", "TRAIN-LOCAL-BACKWARD"  # one of the GPU suite, one CPU-only
CHAPTER = """---
jupytext:
  text_representation: {extension: .md, format_name: myst}
kernelspec: {display_name: Python 3, language: python, name: python3}
---

# A chapter

```{experiment-header} GPU_ID
```

The local backward's evidence: {evidence}`CPU_ID`.

```{code-cell} ipython3
open(RUNS, "a").write("run\\n")
```
""".replace("GPU_ID", GPU_ID).replace("CPU_ID", CPU_ID)
CONF = """import sys
sys.path.insert(0, {ext!r})
extensions = ["myst_nb", "bp_book"]
nb_execution_mode = "cache"
nb_execution_cache_path = {cache!r}
bp_book_results_dir = {records!r}
"""


class Book:
    """The project: sources, a records folder whose contents the test changes, the built pages."""

    def __init__(self, tmp: Path):
        self.src, self.out, self.records, self.runs = tmp / "src", tmp / "out", tmp / "records", tmp / "runs.txt"
        self.src.mkdir()
        self.records.mkdir()
        (self.src / "conf.py").write_text(CONF.format(ext=str(ROOT / "book" / "_ext"), cache=str(tmp / "cache"),
                                                      records=str(self.records)))
        (self.src / "index.md").write_text("# Index\n\n```{toctree}\nchapter\nplain\n```\n")
        (self.src / "chapter.md").write_text(CHAPTER.replace("RUNS", repr(str(self.runs))))
        (self.src / "plain.md").write_text("# Plain\n\nNo header here.\n")
        self.read_at: dict[str, int] = {}

    def set_records(self, records: list[results.Record]) -> None:
        shutil.rmtree(self.records)
        self.records.mkdir()
        for r in records:
            results.save_record(r, self.records)

    def build(self) -> set[str]:
        """Build (incrementally); return the pages that were read in this build."""
        from sphinx.application import Sphinx
        from sphinx.util.docutils import docutils_namespace, patch_docutils

        warnings = io.StringIO()
        with patch_docutils(str(self.src)), docutils_namespace():
            app = Sphinx(str(self.src), str(self.src), str(self.out / "html"), str(self.out / "doctrees"), "html",
                         status=None, warning=warnings)
            app.build()
        assert app.statuscode == 0 and not warnings.getvalue(), warnings.getvalue()
        read = {doc for doc, t in app.env.all_docs.items() if self.read_at.get(doc) != t}
        self.read_at = dict(app.env.all_docs)
        return read

    def header(self) -> str:
        page = (self.out / "html" / "chapter.html").read_text(encoding="utf-8")
        found = re.search(r'<p class="experiment-header">(.*?)</p>', page, re.S)
        assert found, "no experiment-header paragraph on the page"
        return " ".join(html.unescape(re.sub(r"<[^>]+>", "", found.group(1))).split())

    def evidence(self) -> list[str]:
        page = (self.out / "html" / "chapter.html").read_text(encoding="utf-8")
        return [html.unescape(t) for t in re.findall(r'<span class="evidence">(.*?)</span>', page, re.S)]


def expected(e: registry.Experiment, records: Path) -> str:
    return f"{e.semantic_id} · fixed comparison: {e.comparison} · main metrics: {e.metrics} · " \
           f"evidence: {registry.status(e, ROOT, records)}."


def cpu_records(sid: str) -> list[results.Record]:
    """The cached CPU records of ``sid``, made current (the repository's may be stale while code changes)."""
    now = provenance.code_hash(registry.get(sid).module)
    return [dataclasses.replace(r, code_hash=now) for _, r in results.load_records(RESULTS_DIR, sid)
            if r.evidence_level == "cpu-mechanism"]


def gpu_record(r: results.Record) -> results.Record:
    """A GPU record made from a cached CPU one (the fields a GPU run writes), current code."""
    return dataclasses.replace(r, run_label="gpu-default", workload_id="qwen05-b2s512", input_shape=[2, 512],
                               evidence_level="gpu-measured", memory_source="cuda-allocator", model_id="Qwen/Qwen2.5-0.5B",
                               model_source="pretrained", model_commit="060db6499f32faf8b98477b0a26969ef7d8b9987",
                               device_name="NVIDIA H200", device_memory=150_000_000_000, cuda="12.8", threads=None)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    return Book(tmp_path_factory.mktemp("header-book"))


def test_header_follows_the_records_on_every_build(book):
    gpu_e, cpu_e = registry.get(GPU_ID), registry.get(CPU_ID)
    current = cpu_records(GPU_ID) + cpu_records(CPU_ID)
    assert current, "no cached CPU records to start from"

    book.set_records(current)  # 1. the records as cached: fresh CPU records, no GPU record
    assert {"chapter", "plain"} <= book.build()
    assert book.header() == expected(gpu_e, book.records)
    assert book.header().endswith("evidence: complete CPU mechanism; no GPU record cached yet.")
    assert book.evidence() == [registry.status(gpu_e, ROOT, book.records), "complete CPU mechanism"]

    stale = [dataclasses.replace(r, code_hash="0" * 16) for r in current]
    book.set_records(stale)  # 2. the code changed since: same sources, the page is read again
    assert book.build() == {"chapter"}, "only the page that computes its header is read again"
    assert "complete" not in book.header() and "records are stale" in book.header()
    assert book.header() == expected(gpu_e, book.records)
    assert book.evidence()[1] == "CPU mechanism (cached CPU records are stale: code changed since)"

    book.set_records([])  # 3. no record at all
    assert book.build() == {"chapter"}
    assert book.header() == expected(gpu_e, book.records)
    assert book.header().endswith("(no CPU record cached); no GPU record cached yet.")

    now = provenance.code_hash(gpu_e.module)
    gpu = [gpu_record(r) for r in cpu_records(GPU_ID)]
    book.set_records(current + gpu)  # 4. a current GPU record (synthetic), then the same made stale
    book.build()
    assert all(r.code_hash == now for r in gpu)
    assert book.header().endswith("evidence: complete CPU mechanism + GPU cached.")
    book.set_records(current + [dataclasses.replace(r, code_hash="0" * 16) for r in gpu])
    book.build()
    assert book.header().endswith("+ GPU cached (stale: code changed since).")
    assert book.header() == expected(gpu_e, book.records)

    # the notebook ran once, in the first build; every later build took it from the cache
    assert book.runs.read_text().splitlines() == ["run"]
    assert cpu_e.gpu is False and gpu_e.gpu is True


def test_unknown_id_fails_the_build(tmp_path):
    book = Book(tmp_path)
    (book.src / "chapter.md").write_text(CHAPTER.replace("RUNS", repr(str(book.runs))).replace(GPU_ID, "TRAIN-NOPE"))
    with pytest.raises(AssertionError, match="unknown experiment ID 'TRAIN-NOPE'"):
        book.build()
