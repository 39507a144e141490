"""``planner.lifecycle``: the ledger's observer on the one training step. What the offload moves arrives on
the host; host buffers are host bytes; the tracker's peak is the shared peak tool's; the strategies train
the same; on CUDA the allocator is read around every phase; the tracker lets the model go; a skipped
fp16 warm-up step is retried and counted."""

import gc
import weakref

import pytest
import torch

from bp_mech import ledger
from bp_mech.planner import lifecycle
from bp_mech.bench.step import optimizer_state, train_step
from bp_mech.bench.optimizer import StepOptions, make_optimizer
from bp_mech.bench.strategy import PLAIN, Entered, configured, parse
from bp_mech.instruments.tracking import StorageTracker, host_side
from bp_mech.instruments.peak import PeakMemory
from bp_mech.instruments.workload import ARCHITECTURES, build_model, make_batches, parse_workload
from bp_mech.experiments import ledger as experiment
from bp_mech.offload import ActivationOffload, OffloadConfig

TINY = parse_workload("tiny-b2s64")


def tracked_step(model, opt, batch, s, tr, entered=None):
    """One ``train_step`` of strategy ``s`` watched by a ``LedgerObserver`` on ``tr``."""
    with tr, lifecycle.LedgerObserver(tr, model, opt) as observe:
        return train_step(model, opt, batch, s, entered=entered, observers=[observe])


def test_what_offload_moves_arrives_on_the_host():
    """Saved activations and logits the offload moved are exactly the host bytes in use after the forward."""
    plain, off = lifecycle.track(TINY).stages["forward"], lifecycle.track(TINY, parse("offload"))
    moved = sum(plain[c] - off.stages["forward"][c] for c in ("saved_activations", "logits_loss"))
    assert off.host["forward"] == moved > 0 and off.host["load"] == 0


def test_host_buffers_are_host_bytes_even_when_allocated_inside_the_step():
    """The offload's pool allocates its host buffers in its first step, inside the ``host_region`` the tracker's ``host_side`` observes; the
    tracker books them as host bytes (never as device bytes) there as in a steady step that reuses them."""
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = make_optimizer(model.parameters(), StepOptions(), "cpu")
    s = parse("offload")
    hooks = ActivationOffload(model.parameters(), OffloadConfig(min_bytes=StepOptions().for_device("cpu")
                                                                .offload_min_bytes), "cpu",
                              host_region=host_side)  # the tracker observes the pool's allocations
    seen = []
    for _ in range(2):  # first step: the pool allocates; second: it reuses its buffers
        tr = StorageTracker("cpu")
        tracked_step(model, opt, batch, s, tr, Entered(model, s, "cpu", hooks=hooks))
        seen.append((tr.marks["forward"][0], sum(tr.host.values()), tr.marks["forward"][2]))
    (dev1, host1, in_use1), (dev2, host2, in_use2) = seen
    assert dev1 == dev2 and host1 == host2 == hooks.pool.allocated > 0 and in_use1 == in_use2 > 0


def test_tracker_peak_equals_the_shared_peak_memory_tool():
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = make_optimizer(model.parameters(), StepOptions(), "cpu")
    train_step(model, opt, batch)  # warm-up: AdamW's moments
    with PeakMemory("cpu", resident=[model.parameters(), model.buffers(), optimizer_state(opt), batch.values()]) as pm:
        train_step(model, opt, batch)
    assert pm.peak.allocated == lifecycle.track(TINY).peak


LR = 1e-3  # the learning rate of the equality test's single AdamW update
ADAM_EPS = 1e-8  # torch's default AdamW eps
GRAD_RTOL = 1e-5  # float32 reordering: a gradient may differ by this relative to its tensor's max |g|


def _one_update(name):
    """One AdamW update of strategy ``name`` from the same weights: loss, the gradients the update used
    (copied by a step pre-hook, i.e. before it), and the parameters before and after."""
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = make_optimizer(model.parameters(), StepOptions(lr=LR), "cpu")
    grads, before = [], [p.detach().clone() for p in model.parameters()]
    opt.register_step_pre_hook(lambda *_: grads.extend(p.grad.detach().clone() for p in model.parameters()))
    s = parse(name)
    with configured(model, s):
        loss = tracked_step(model, opt, batch, s, StorageTracker("cpu"), Entered(model, s, "cpu")).loss
    return loss, grads, before, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["checkpoint-all", "offload", "micro2"])
def test_memory_strategies_train_the_same_as_plain(strategy):
    """Compared where the comparison is well-conditioned. The gradients: equal up to float32
    reordering (accumulation sums two micro-batches; other CPUs' kernels order sums differently).
    The update: AdamW's first step moves an element by lr * g / (|g| + eps) (m_hat = g, v_hat = g^2),
    so where |g| is near eps a reordering-sized change of g (even of its sign) moves the update by up
    to 2 lr: there only that bound holds. Where |g| >= 1000 eps and |g| exceeds the gradient's
    tolerance (no sign change), the update moves by lr * (eps / |g|) * (dg / |g|) <= lr * 1e-3, plus
    the rounding of p."""
    loss0, g0, _, p0 = _one_update("plain")
    loss1, g1, _, p1 = _one_update(strategy)
    assert torch.allclose(loss0, loss1, rtol=1e-5, atol=0)  # float32: reordering only
    f32 = torch.finfo(torch.float32).eps
    for g, h, a, b in zip(g0, g1, p0, p1):
        tol = GRAD_RTOL * g.abs().max()
        assert (h - g).abs().max() <= tol, ((h - g).abs().max() / g.abs().max()).item()
        diff = (b - a).abs()  # both updates start from the same weights
        assert diff.max() <= 2 * LR * (1 + 1e-6) + 4 * f32 * a.abs().max()
        sure = (g.abs() >= 1000 * ADAM_EPS) & (g.abs() >= tol)
        assert (diff[sure] <= LR * 1e-3 + 4 * f32 * a.abs()[sure]).all(), (diff[sure] / LR).max().item()


# --- the CUDA paths, exercised on the CPU ---------------------------------------------


def test_tracker_reads_the_allocator_around_every_phase(fake_cuda):
    """On CUDA a phase's start resets the allocator's peak and the next start reads it (after a
    synchronize); a stage mark reads the allocated bytes. The device decides; tensors stay on the CPU."""
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tr = StorageTracker("cuda")
    tracked_step(model, opt, batch, PLAIN, tr, Entered(model, PLAIN, "cpu"))
    mark = ["synchronize", "memory_allocated"]
    read = ["synchronize", "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats"]
    # start forward, mark forward, start backward, mark backward, start optimizer, start zero_grad, mark, idle
    assert fake_cuda == ["reset_peak_memory_stats"] + mark + read + mark + read + read + mark + read
    phases = ("forward", "backward", "optimizer", "zero_grad")
    assert set(tr.allocator) == {"forward", "backward", "zero_grad"} | {f"{p}_{k}" for p in phases
                                                                       for k in ("peak", "reserved")}


def test_the_tracker_lets_the_model_go_after_a_step():
    """The allocator counts every live tensor: a tracker (kept alive by its own weakref callbacks
    until the cycle collector runs) must not hold the autograd graph, which holds every parameter."""
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tr = StorageTracker("cpu")
    tracked_step(model, opt, batch, PLAIN, tr)
    param = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    del model, opt
    gc.collect()
    assert param() is None and not tr.loss_nodes


def test_a_skipped_warm_up_step_is_retried_and_counted(monkeypatch):
    """fp16: a step the GradScaler skips (inf/NaN) allocates no AdamW state. ``track`` warms up again,
    so the measured step is still steady-state, and the skip is counted."""
    class SkipOnce(torch.amp.GradScaler):  # an infinite first scale: the first step overflows
        def __init__(self, device, enabled=True):
            super().__init__(device, init_scale=float("inf"), enabled=enabled)

        def update(self, new_scale=None):
            super().update(2.0**16 if self.get_scale() == float("inf") else new_scale)

    monkeypatch.setattr(torch.amp, "GradScaler", SkipOnce)
    led = lifecycle.track(TINY, parse("fp16"))
    assert (led.updates, led.skipped, led.finite) == (3, 1, True)
    formula = ledger.theoretical(ARCHITECTURES["tiny"], TINY.batch, TINY.seq, parse("fp16"))
    assert max(abs(e) for e in experiment.stage_errors(formula, led).values()) <= experiment.STAGE_TOL
