"""The book build's page order (tools/book_build.py): Sphinx's parallel read executes one page per chunk,
the longest first, whatever order Sphinx's ``ParallelTasks`` starts its waiting chunks in."""

import sys
import time

from sphinx.util.parallel import ParallelTasks

from bp_mech import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import book_build  # noqa: E402


GATE = {}  # the file the first page waits for (a forked task sees the test's value)


def _read(chunk):
    while not GATE["path"].exists():  # the build adds every page before the first is read: so here
        time.sleep(0.01)
    return chunk[0]


def test_parallel_tasks_run_the_pages_in_the_given_order(tmp_path):
    """On one worker the order Sphinx runs the chunks in is the order they finish in, exactly. As in the
    build, where reading a page takes seconds, every chunk is added before the first one finishes."""
    order = ["f", "c", "a", "e", "b", "d"]
    chunks = book_build.chunks(sorted(order), 1, order=order)
    assert all(len(c) == 1 for c in chunks) and sorted(c[0] for c in chunks) == sorted(order)
    done = []
    GATE["path"] = tmp_path / "go"
    tasks = ParallelTasks(1)
    for chunk in chunks:
        tasks.add_task(_read, chunk, lambda arg, result: done.append(result))
    GATE["path"].touch()
    tasks.join()
    assert done == order
    assert book_build.chunks(["x", *order], 2, order=order)[0] == ["x"]  # a page the order does not name: first


def test_the_page_order_reads_the_last_build_log_else_the_sizes(tmp_path, monkeypatch):
    monkeypatch.setattr(book_build, "LOG", tmp_path / "build.log")
    by_size = book_build.page_order()
    sizes = [(ROOT / f"{d}.md").stat().st_size for d in by_size]
    assert sizes == sorted(sizes, reverse=True) and "book/index" in by_size
    log = "".join(f"{ROOT / d}.md: Executed notebook in {i + 1}.5 seconds [mystnb]\n" for i, d in enumerate(by_size))
    (tmp_path / "build.log").write_text(log)
    assert book_build.page_order() == by_size[::-1]  # the log's seconds, not the sizes
