"""Issue 29's slips, each kept fixed: words whose truth depends on a run are glued (tests/book/test_claims.py
tests the functions that choose them), the GPU evidence is no section of its own while there is none,
the check sample is a slip's output, and significands are counted one way."""

import re

import pytest

from bp_mech import ROOT

PAGES = sorted((ROOT / "book").glob("part02/*.md")) + sorted((ROOT / "book").glob("projects/*.md"))


def text(name: str) -> str:
    return next(p for p in PAGES if p.name.startswith(name)).read_text(encoding="utf-8")


@pytest.mark.parametrize("page, typed", [
    ("55-", "Why the high LR ends lower"),
    ("55-", "why does the high-LR run end lower here"),
    ("42-", "Why offload + checkpointing peaks higher"),
    ("42-", "yet peaked higher"),
    ("12b-", "does not overflow where float32 would not"),
    ("12b-", "The logits' gradient is not where"),
])
def test_a_run_dependent_claim_is_not_typed(page, typed):
    assert typed not in text(page)


def test_the_run_dependent_words_are_glued():
    assert "{glue:text}`of_tl_why`" in text("42-") and "{glue:text}`of_tl_vs_off`" in text("42-")
    assert "{glue:text}`amp_ref_vs_sub`" in text("12b-") and "{glue:text}`amp_ref_fate`" in text("12b-")
    assert "{glue:text}`ck_tl_vs_table`" in text("19-")  # the caption's peak against the table's


def test_significands_are_counted_one_way():
    """The stored bits after the implicit one (12b's table and prose, 76's fp16): nowhere "+ 1"."""
    assert "counts the stored bits after the implicit leading one" in text("12b-")
    assert not re.search(r"finfo\(torch\.float16\)\.eps\)\)\.item\(\)\) \+ 1", text("76-"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_no_page_has_an_empty_gpu_records_section_or_the_stubs_todo_list(page):
    s = page.read_text(encoding="utf-8")
    assert not re.search(r"^#+ GPU( records)?\s*$", s, re.M)
    assert "nothing cached (see the note above)" not in s
    assert "sample_output(" not in s and "On the untouched stubs it prints" not in s
