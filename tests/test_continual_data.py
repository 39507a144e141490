"""``continual_data``: a text's identity by hashlib, the held-out tail by hand, the reader's own files, and
the stream's rows found in the text by brute force. The stream's state round trip and its short-text
wrap: ``tests/test_continual_pretrain.py``."""

import hashlib

import pytest
import torch

from bp_mech.continual_data import TextStream, load_texts, split_text, text_sha256
from bp_mech.instruments.workload import WorkloadError


def test_the_identity_is_the_sha256_of_the_int64_ids_whatever_their_dtype():
    ids = torch.tensor([1, 2, 300], dtype=torch.int32)
    want = hashlib.sha256(b"".join(i.to_bytes(8, "little") for i in (1, 2, 300))).hexdigest()[:16]
    assert text_sha256(ids) == text_sha256(ids.long()) == want


@pytest.mark.parametrize("n, fraction, train, held", [(100, 0.1, 90, 10), (10, 0.01, 8, 2), (7, 0.5, 3, 4)])
def test_the_held_out_tail_is_the_rounded_fraction_and_at_least_two_tokens(n, fraction, train, held):
    ids = torch.arange(n)
    a, b = split_text(ids, fraction)
    assert (len(a), len(b)) == (train, held) and torch.equal(torch.cat([a, b]), ids)


def test_a_text_too_short_to_split_is_refused():
    with pytest.raises(ValueError, match="too short"):
        split_text(torch.arange(3), 0.5)


def test_the_reader_s_own_files_replace_domain_and_holdout(tmp_path):
    domain = tmp_path / "domain.txt"
    domain.write_text("a domain text of my own, long enough to train on. " * 2, encoding="utf-8")
    texts = load_texts(domain_path=domain)
    assert texts["domain"].source == str(domain) and texts["general"].source == "shipped:prose[:-20%]"
    assert texts["holdout"].source == "shipped:prose[-20%:]"
    short, bad = tmp_path / "short.txt", tmp_path / "bad.txt"
    short.write_text("tiny", encoding="utf-8")
    bad.write_bytes(b"\xff\xfe\xfa not utf-8")
    with pytest.raises(WorkloadError, match="at least 16"):
        load_texts(holdout_path=short)
    with pytest.raises(WorkloadError, match="cannot read the domain text"):
        load_texts(domain_path=bad)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_texts(domain_path=tmp_path / "missing.txt")


def test_every_row_is_a_window_of_the_text_and_the_labels_equal_the_inputs():
    ids = torch.randperm(50, generator=torch.Generator().manual_seed(0))  # each token once: a row finds its offset
    stream = TextStream(ids, batch=3, seq=8, seed=4)
    offsets = set()
    for k in range(20):
        b = stream.next()
        assert torch.equal(b["labels"], b["input_ids"]) and b["input_ids"].shape == (3, 8)
        for row in b["input_ids"]:
            s = int((ids == row[0]).nonzero())
            assert s + 8 <= 50 and torch.equal(row, ids[s:s + 8])
            offsets.add(s)
    assert stream.position == 20 and stream.tokens == 20 * 3 * 8
    assert len(offsets) > 20  # drawn, not a fixed set of offsets


def test_two_streams_with_one_seed_draw_the_same_batches():
    ids = torch.arange(40)
    a, b = TextStream(ids, 2, 5, seed=9), TextStream(ids, 2, 5, seed=9)
    assert all(torch.equal(a.next()["input_ids"], b.next()["input_ids"]) for _ in range(5))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        TextStream(ids[:1], 1, 4, 0)
