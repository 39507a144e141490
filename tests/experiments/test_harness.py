"""The harness (``harness.measure``, used by every experiment that times training steps) on a toy step:
the steps it runs, the peak's resident bytes, ``finish``, an out-of-memory arm on both paths; the dry
run's protocol (``dry_run.own_weights_modes``)."""

import pytest
import torch

from bp_mech.bench.oom import Failed
from bp_mech.bench.step import StepResult
from bp_mech.experiments import dry_run, harness


class ToyStep:
    """One SGD step of a linear layer (its own copy); counts its calls, keeps its layer for ``finish``."""

    def __init__(self, width: int) -> None:
        self.layer, self.calls = torch.nn.Linear(width, width), []
        self.opt = torch.optim.SGD(self.layer.parameters(), lr=0.1)

    def __call__(self, i: int) -> StepResult:
        self.calls.append(i)
        loss = self.layer(torch.ones(4, self.layer.in_features)).pow(2).sum()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepResult(loss.detach(), applied=i % 2 == 0)


def prepare_toys(made: dict, oom: str | None = None):
    def prepare(name, together):
        if name == oom:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        toy = ToyStep({"a": 8, "b": 16}[name])
        made[name] = (toy, together)
        return harness.Run(toy, lambda: [list(toy.layer.parameters())])
    return prepare


@pytest.mark.parametrize("together", [True, False])
def test_steps_resident_bytes_and_finish(together):
    made = {}
    out = harness.measure(["a", "b"], prepare_toys(made), "cpu", 3, 1, together=together,
                          finish=lambda name, run: dict(calls=list(made[name][0].calls), steps=len(run.log)))
    for name, width in (("a", 8), ("b", 16)):
        m = out[name]
        assert isinstance(m, harness.Measured) and made[name][1] is together
        assert m.finish["steps"] == dry_run.steps_per_arm(3, 1) == 1 + 1 + 3  # tracked + warm-up + timed
        assert m.finish["calls"][0] == -1 and len(m.finish["calls"]) == m.finish["steps"]  # -1: the tracked step
        assert m.applied == [i % 2 == 0 for i in m.finish["calls"]]
        assert (m.updates, m.skipped) == (sum(m.applied), len(m.applied) - sum(m.applied))
        assert m.resident_bytes == 4 * (width * width + width)  # float32 weight and bias
        t = m.timing
        assert t.interleaved is together and len(t.samples) == 3 and t.warmup_excluded == 1
        assert m.peak.source == "tracked-cpu" and m.peak.allocated >= m.resident_bytes
        fields = m.record_fields()
        assert fields["peak_allocated"] == m.peak.allocated and fields["updates"] == m.updates


@pytest.mark.parametrize("together", [True, False])
def test_an_out_of_memory_arm_is_its_own_failure(together):
    made = {}
    out = harness.measure(["a", "b"], prepare_toys(made, oom="a"), "cpu", 2, 0, together=together)
    assert list(out) == ["a", "b"] and isinstance(out["a"], Failed) and out["a"].name == "a"
    assert out["a"].failure.startswith("out of memory")
    assert isinstance(out["b"], harness.Measured) and len(out["b"].timing.samples) == 2


def test_other_errors_propagate():
    def prepare(name, together):
        raise ValueError("a bug, not a lack of memory")

    with pytest.raises(ValueError, match="a bug"):
        harness.measure(["a"], prepare, "cpu", 1, 0)


def test_own_weights_modes_add_the_protocol():
    plan = dry_run.own_weights_modes(lambda dev: (20 if dev == "cuda" else 60, 2,
                                                  dict(estimated_seconds=1.0, note=dev)))
    assert list(plan) == ["cpu", "real_gpu"]
    cpu, gpu = plan["cpu"], plan["real_gpu"]
    assert (cpu["timed_rounds"], cpu["warmup_rounds"], cpu["measured_steps"]) == (60, 2, 63)
    assert (gpu["timed_rounds"], gpu["warmup_rounds"], gpu["measured_steps"]) == (20, 2, 23)
    assert cpu["interleaved"] and cpu["threads"] == 1 and not gpu["interleaved"] and gpu["threads"] is None
    assert cpu["note"] == "cpu" and gpu["note"] == "cuda" and gpu["estimated_seconds"] == 1.0
