"""The provenance box beside cached GPU records (report.provenance_box) and the course's reference run.

No GPU record is cached: a synthetic one, made from a cached CPU record with the fields a GPU
run writes, goes through the cache (saved, validated, loaded by ``records.cache.cached``) in tmp_path.
"""

import dataclasses
import html

import pytest

from bp_mech import RESULTS_DIR
from bp_mech.records import cache, provenance, references, registry, results
from bp_mech.book import report

SID = "TRAIN-CHECKPOINT"


def _gpu_record(candidate: str, code_hash: str) -> results.Record:
    _, cpu = next((p, r) for p, r in results.load_records(RESULTS_DIR, SID) if r.candidate == candidate)
    return dataclasses.replace(
        cpu, run_label="gpu-default", workload_id="qwen05-b2s512", input_shape=[2, 512], evidence_level="gpu-measured",
        memory_source="cuda-allocator", model_id="Qwen/Qwen2.5-0.5B", model_source="pretrained",
        model_commit="060db6499f32faf8b98477b0a26969ef7d8b9987", device_name="NVIDIA H200",
        device_memory=150_000_000_000, cuda="12.8", torch="2.11.0", transformers="5.17.0", threads=None,
        created_at="2026-03-01T12:00:00+00:00", code_hash=code_hash, git_commit="0123456789abcdef0123")


def _cache(tmp_path, code_hash):
    for c in ("plain", "checkpoint-all"):
        results.save_record(_gpu_record(c, code_hash), tmp_path)
    cached = cache.cached(SID, tmp_path)
    return cached, cached.gpu()["gpu-default"]


def test_box_of_a_current_gpu_record(tmp_path):
    now = provenance.code_hash(registry.get(SID).module)
    cached, recs = _cache(tmp_path, now)
    assert cached.stale == set() and not any(provenance.is_stale(r, registry.get(SID).module) for r in recs)
    box = report.provenance_box(recs)
    rows = dict(box.rows)
    assert box.stale is False and "STALE" not in box.title and "2 candidates" in box.title
    assert rows["device"] == "NVIDIA H200, 139.70 GiB, CUDA 12.8, torch 2.11.0, transformers 5.17.0"
    assert rows["workload"].startswith("qwen05-b2s512, input [2, 512]")
    assert rows["model"] == "Qwen/Qwen2.5-0.5B, pretrained weights at commit 060db6499f32"
    assert rows["date"] == "2026-03-01T12:00:00+00:00"
    assert rows["evidence"] == "gpu-measured (memory: cuda-allocator)"
    assert rows["code"].startswith(f"current: code_hash {now} matches this source; git commit 0123456789ab")
    ref = references.REFERENCES[SID]
    assert rows["reference"].startswith(ref.summary()) and "not this book's measurement" in rows["reference"]
    page = box._repr_html_()
    assert 'class="admonition note bp-provenance"' in page and html.escape(rows["model"]) in page
    assert box._repr_markdown_().startswith(":::{admonition} Provenance: TRAIN-CHECKPOINT, run label gpu-default")
    assert "device: NVIDIA H200" in repr(box)


def test_box_of_a_stale_gpu_record_says_so(tmp_path):
    cached, recs = _cache(tmp_path, "0" * 16)
    assert cached.stale == {"gpu-default"}
    box = report.provenance_box(recs[0])  # one record
    code = dict(box.rows)["code"]
    assert box.stale is True and box.title.endswith("candidate checkpoint-all — STALE")
    assert code.startswith("STALE: the code changed since this run (record code_hash 0000000000000000, this source "
                           f"{provenance.code_hash(registry.get(SID).module)}; stale: checkpoint-all)")
    assert 'class="admonition warning bp-provenance"' in box._repr_html_()


def test_box_without_a_course_reference_and_config_model():
    rec = dataclasses.replace(_gpu_record("plain", "x"), semantic_id="TRAIN-UPDATE-DYNAMICS", model_source="config",
                              model_commit="c0ffee" * 4)
    rows = dict(report.provenance_box(rec).rows)
    assert "reference" not in rows and references.for_experiment("TRAIN-UPDATE-DYNAMICS") is None
    assert rows["model"].startswith("Qwen/Qwen2.5-0.5B, random init from the config (config hash c0ffeec0ffee)")


def test_box_escapes_html():
    rec = dataclasses.replace(_gpu_record("plain", "x"), device_name="<b>GPU</b> & co")
    page = report.provenance_box(rec)._repr_html_()
    assert "<b>GPU</b>" not in page and "&lt;b&gt;GPU&lt;/b&gt; &amp; co" in page


@pytest.mark.parametrize("sid, phrase", [
    ("TRAIN-CHECKPOINT", "peak down about 33.7%, median step up about 19.2%, decision accept"),
    ("TRAIN-OFFLOAD", "peak down about 34.3%, median step 5.87×, decision tune"),
    ("TRAIN-AMP-BACKWARD", "peak down about 10.7%, time about equal"),
    ("TRAIN-GRADIENT-ACCUMULATION", "at seq 256: peak down up to about 17.3%, median step up about 33.5%; "
                                    "short sequences: decision tune"),
])
def test_reference_summaries_read_as_design_md_table(sid, phrase):
    ref = references.REFERENCES[sid]
    s = ref.summary()
    assert s.startswith("the course's reference run (RTX 5070 Ti, Qwen2.5-0.5B, run label ") and s.endswith(phrase)
    assert ref.source == "the course's reference run (RTX 5070 Ti, Qwen2.5-0.5B)" and "seed" not in s.lower()
