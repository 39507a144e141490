"""The harness's measurement for candidates that each own their model (``harness.measure_separate``,
used by AMP, Part 02 · 11 and Part 02 · 55) and its plan (``harness.plan_separate``), on a toy step:
the steps it runs, the peak's resident bytes, ``finish``, and an out-of-memory candidate on both paths."""

import pytest
import torch

from bp_mech.experiments import harness


class ToyStep:
    """One SGD step of a linear layer (its own copy); counts its calls, keeps its layer for ``finish``."""

    def __init__(self, width: int) -> None:
        self.layer, self.calls = torch.nn.Linear(width, width), []
        self.opt = torch.optim.SGD(self.layer.parameters(), lr=0.1)

    def __call__(self, i: int) -> None:
        self.calls.append(i)
        self.layer(torch.ones(4, self.layer.in_features)).pow(2).sum().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def prepare_toys(made: dict, oom: str | None = None):
    def prepare(name, together):
        if name == oom:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        made[name] = (ToyStep({"a": 8, "b": 16}[name]), together)
        return made[name][0], [made[name][0].layer.parameters()]  # a generator: the harness keeps a list
    return prepare


@pytest.mark.parametrize("interleave", [True, False])
def test_steps_resident_bytes_and_finish(interleave):
    made = {}
    out = harness.measure_separate(prepare_toys(made), ["a", "b"], "cpu", 3, 1, interleave=interleave,
                                   finish=lambda name, step, stats: dict(calls=list(step.calls), width=name))
    for name, width in (("a", 8), ("b", 16)):
        r, failure = out[name]
        assert failure is None and made[name][1] is interleave  # together only when interleaved
        assert r["steps"] == harness.separate_steps("cpu", 3, 1) == 1 + 1 + 3  # tracked + warm-up + timed
        assert r["calls"][0] == -1 and len(r["calls"]) == r["steps"] and r["width"] == name  # -1: the tracked step
        assert r["resident_bytes"] == 4 * (width * width + width)  # float32 weight and bias
        t = r["stats"].timing
        assert t.interleaved is interleave and len(t.samples) == 3 and t.warmup_excluded == 1
        assert r["stats"].memory_source == "tracked-cpu" and r["stats"].peak_allocated >= r["resident_bytes"]


@pytest.mark.parametrize("interleave", [True, False])
def test_an_out_of_memory_candidate_is_its_own_failure(interleave):
    made = {}
    out = harness.measure_separate(prepare_toys(made, oom="a"), ["a", "b"], "cpu", 2, 0, interleave=interleave)
    assert list(out) == ["a", "b"] and out["a"][0] is None and out["a"][1].startswith("out of memory")
    assert out["b"][1] is None and len(out["b"][0]["stats"].timing.samples) == 2


def test_other_errors_propagate():
    def prepare(name, together):
        raise ValueError("a bug, not a lack of memory")

    with pytest.raises(ValueError, match="a bug"):
        harness.measure_separate(prepare, ["a"], "cpu", 1, 0)


def test_plan_separate_adds_the_protocol():
    plan = harness.plan_separate(lambda dev: (20 if dev == "cuda" else 60, 2, dict(estimated_seconds=1.0, note=dev)))
    assert list(plan) == ["cpu", "real_gpu"]
    cpu, gpu = plan["cpu"], plan["real_gpu"]
    assert (cpu["timed_rounds"], cpu["warmup_rounds"], cpu["measured_steps"]) == (60, 2, 63)
    assert (gpu["timed_rounds"], gpu["warmup_rounds"], gpu["measured_steps"]) == (20, 2, 22)
    assert cpu["interleaved"] and cpu["threads"] == 1 and not gpu["interleaved"] and gpu["threads"] is None
    assert cpu["note"] == "cpu" and gpu["note"] == "cuda" and gpu["estimated_seconds"] == 1.0
