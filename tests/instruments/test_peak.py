"""``instruments.peak``: the record fields of a peak and the unit of a size. ``PeakMemory`` on the
tracker (resident tensors, marks, views, nesting) is held by ``tests/instruments/test_tracking.py``."""

import pytest
import torch

from bp_mech.instruments.peak import Peak, PeakMemory, fmt_bytes


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (2**20, "1.00 MiB"),
    (5 * 2**30 + 2**29, "5.50 GiB"), (-3 * 2**20, "-3.00 MiB"), (12.7, "12 B"), (None, "–"),
])
def test_a_size_takes_the_largest_unit_it_reaches(n, text):
    assert fmt_bytes(n) == text


def test_a_peak_fills_the_record_s_memory_fields():
    assert Peak(4096, None, "tracked-cpu").record_fields() == dict(
        peak_allocated=4096, peak_reserved=None, memory_source="tracked-cpu")


def test_the_cpu_reader_marks_live_bytes_and_reads_zero_outside_its_block():
    pm = PeakMemory("cpu")
    assert pm.current() == 0 and pm.memory_source == "tracked-cpu"
    with pm:
        x = torch.empty(100, dtype=torch.float64)  # 800 B
        assert pm.mark("x") == 800
    assert pm.peak == Peak(800, None, "tracked-cpu") and pm.marks == {"x": 800}
    del x
