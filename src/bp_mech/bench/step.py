"""The training step: one full update under a memory strategy, watched through its phases.

Every measured step and every training loop of the package is this one function (``train_step``): the
experiments' timed and tracked steps, Part 02 · 43's ledger (``planner.lifecycle``), ``bp-mech plan``'s
fake-tensor trace, the profiler of project 74, and the loops that keep state from one update to the
next through ``bench.trainer.Trainer`` (AMP's overflow sample, Part 02 · 12's clock run, Part 02 · 56's
continual pretraining and its conformance, the book's clock plots) or call it directly (Part 02 · 11's
token-weighted equivalence run). Its phases, in order::

    for each micro-batch:  "forward"   (under the strategy's offload hooks and autocast)
                           "backward"  (the loss scaled under fp16)
    "optimizer"            (``apply_update``: unscale and clip when asked, the optimizer's step through
                            the scaler, the LR clock)
    "zero_grad"            (set_to_none: the next step starts with no gradients)

What stays outside it, on purpose (``tests/bench/test_step_users.py`` holds the same list and fails on
any other loop that calls a backward and an optimizer's step):

* a framework's own idiom that a chapter shows as such: Accelerate's ``accelerator.backward`` inside
  ``accelerator.accumulate`` and the prepared optimizer's step, in ``accumulation_framework.accelerate_updates``
  (Part 02 · 11) and in project 73's loop ``projects.baseline_loop.run_updates`` (its divisor counts
  target tokens across processes);
* a mistake a chapter demonstrates, which no strategy should carry: ``amp.clipping_order`` (clipping the
  still-scaled gradients) and the naive mean-of-means normalisation of Part 02 · 11's equivalence
  run, ``experiments.accumulation_updates.train_updates``;
* references that drive torch's own ``GradScaler`` on one parameter, to compare a scaler with:
  ``experiments.amp.conformance`` and the exercise checks (``bp_mech.checks``).

An *observer* is a callable ``observer(phase, state) -> context manager`` entered around each phase
(``state``: a ``StepState``, the loss of the micro-batch once its forward has run): the ledger's
storage tracker marks its stages there, the profiler opens a ``record_function`` range, a probe
marks the live bytes. ``probe`` is the step without the update (loss and gradients from the current
weights, for comparing strategies); ``optimizer_state`` lists the optimizer's tensors.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch

from bp_mech.instruments.counters import ForwardCounter, SavedBytesCounter
from bp_mech.bench.strategy import PLAIN, Entered, Strategy, enter
from bp_mech.instruments.peak import PeakMemory
from bp_mech.scheduler import UpdateClock, scaler_step
from bp_mech.update_dynamics import global_grad_norm

PHASES = ("forward", "backward", "optimizer", "zero_grad")


@dataclass
class StepState:
    """What an observer sees of the step in progress."""

    model: torch.nn.Module
    opt: object  # the optimizer (None in a probe)
    strategy: Strategy
    entered: Entered  # the strategy entered on the model: offload hooks, scaler, transfer counts
    micro: int = 0  # the micro-batch in progress (0 .. k - 1)
    loss: torch.Tensor | None = None  # the micro-batch's loss, from the end of its forward to the end of its backward


Observer = Callable[[str, StepState], ContextManager]


@dataclass
class StepResult:
    """What one step gives back."""

    loss: torch.Tensor  # detached: the batch's mean token loss (micro-batches: their token-weighted shares summed)
    applied: bool  # the optimizer applied the update (False: the fp16 scaler skipped it, or no update was asked)
    grad_norm: torch.Tensor | None = None  # with ``max_norm``: the total gradient norm before clipping (unscaled)
    scale: float | None = None  # fp16: the loss scale the step's backward used


@contextlib.contextmanager
def _phase(name: str, state: StepState, observers: Sequence[Observer]):
    with contextlib.ExitStack() as stack:
        for observe in observers:
            stack.enter_context(observe(name, state))
        yield


def train_step(model, opt, batch: dict, strategy: Strategy = PLAIN, *,
               entered: Entered | None = None, observers: Sequence[Observer] = (),
               update: bool = True, max_norm: float | None = None,
               clock: UpdateClock | None = None,
               outputs: list | None = None) -> StepResult:
    """One training step of ``model`` on ``batch`` under ``strategy``.

    Args:
        model: a causal LM whose ``model(**batch).loss`` is the mean token loss.
        opt: its optimizer (None only with ``update=False``).
        batch: ``input_ids`` and ``labels`` of shape (B, T); B must split into the
            strategy's micro-batches.
        strategy: the memory strategy (``bench.strategy.Strategy``); default plain.
        entered: the strategy already entered on ``model`` (``bench.strategy.enter``),
            to reuse across steps (the offload's host pool, the scaler's state); None
            enters it for this one step.
        observers: callables ``(phase, state) -> context manager`` entered around each
            phase (``PHASES``).
        update: False stops after the backward (a probe): the gradients stay, unscaled
            under fp16.
        max_norm: clip the total gradient norm to it, after unscaling (None: no
            clipping).
        clock: an LR clock (``scheduler.UpdateClock``) advanced by every optimizer call,
            counting only the updates that were applied.
        outputs: a list that keeps the model's outputs (the logits) as the loop
            variable of ``out = model(**batch); out.loss.backward()`` does: each
            forward's outputs replace the last ones once that forward has run, and the
            last stay in it after the step (None: dropped at once).

    Returns:
        a ``StepResult``: the detached loss, whether the update was applied, the
        pre-clip norm, the scale.

    Gradients an earlier call left (a probe, a user's own backward) are dropped first:
    every step starts from none, as the zero_grad that ends each step leaves it.
    """
    if entered is None:
        device = next(model.parameters()).device
        with enter(model, strategy, device) as e:
            return train_step(model, opt, batch, strategy, entered=e,
                              observers=observers, update=update, max_norm=max_norm,
                              clock=clock, outputs=outputs)
    if entered.strategy != strategy or entered.model is not model:
        raise ValueError(f"entered is {entered.strategy.name!r} on another model; "
                         f"train_step was asked for {strategy.name!r}")
    if update and opt is None:
        raise ValueError("a step that updates needs an optimizer")
    k, rows = strategy.micro_batches, batch["input_ids"].shape[0]
    if rows % k:
        raise ValueError(f"accumulation needs micro_batches ({k}) to divide "
                         f"the batch ({rows})")
    model.zero_grad(set_to_none=True)
    scaler, state = entered.scaler, StepState(model, opt, strategy, entered)
    scale = scaler.get_scale() if scaler.is_enabled() else None
    entered.d2h_bytes = entered.h2d_bytes = 0
    losses = []
    with entered.micro_batches(batch) as micro:
        for i, mb in enumerate(micro):
            state.micro = i
            with _phase("forward", state, observers):
                with entered.forward():
                    out = model(**mb)
                    state.loss = out.loss
                # kept: the last micro-batch's (or step's) are freed only now
                if outputs is not None:
                    outputs[:] = [out]
                # otherwise the outputs (the logits, when they exist) are dropped here
                del out
            with _phase("backward", state, observers):
                scaler.scale(state.loss).backward()
                # the hooks' counters cover the last forward and its backward
                entered.count_transfers()
            losses.append(state.loss.detach())
            state.loss = None
    loss = torch.stack(losses).sum() if len(losses) > 1 else losses[0]
    if not update:
        # the true gradients, as GradScaler.unscale_ gives them (the scale is a
        # power of 2)
        if scale is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / scale)
        return StepResult(loss, False, None, scale)
    with _phase("optimizer", state, observers):
        done, norm = apply_update(model, opt, scaler, max_norm, clock)
    with _phase("zero_grad", state, observers):
        opt.zero_grad(set_to_none=True)
    return StepResult(loss, done, norm, scale)


def apply_update(model, opt, scaler: torch.amp.GradScaler,
                 max_norm: float | None = None,
                 clock: UpdateClock | None = None) -> tuple[bool, torch.Tensor | None]:
    """``train_step``'s optimizer phase: unscale, clip, step through the scaler, clock.

    Args:
        model: the model whose gradients the backward left (times the scale).
        opt: its optimizer.
        scaler: the step's GradScaler; disabled (every strategy but fp16), it
            passes every call through and the optimizer always steps.
        max_norm: clip the total gradient norm to it, after unscaling (None: no
            clipping).
        clock: an LR clock (``scheduler.UpdateClock``) told whether the update
            was applied (None: none).

    Returns:
        ``(applied, norm)``: False when the scaler skipped the update (a gradient
        was inf/NaN); the total norm before clipping (None without ``max_norm``).

    Example:
        >>> m = torch.nn.Linear(2, 1, bias=False)
        >>> opt = torch.optim.SGD(m.parameters(), lr=1.0)
        >>> _ = m.weight.data.fill_(1.0)
        >>> m.weight.grad = torch.tensor([[3.0, 4.0]])  # norm 5
        >>> off = torch.amp.GradScaler("cpu", enabled=False)
        >>> done, norm = apply_update(m, opt, off, max_norm=1.0)
        >>> done, norm.item(), [round(x, 4) for x in m.weight[0].tolist()]
        (True, 5.0, [0.4, 0.2])
    """
    norm = None
    if max_norm is not None:
        # BEFORE clipping: max_norm is in the units of the true gradient
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if scaler.is_enabled():
        # skipped (scale backed off) when a gradient is inf/NaN
        done = scaler_step(scaler, opt)
    else:
        opt.step()
        done = True
    if clock is not None:
        clock.step(done)
    return done, norm


def optimizer_state(opt) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state (AdamW: each parameter's exp_avg, exp_avg_sq and step)."""
    return [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]


@dataclass
class Probe:
    """One step without the update: what the timed steps do not show."""

    loss: float
    grads: list  # a copy of every parameter's gradient (None where it has none), on the device
    grad_norm: float  # the total gradient norm, float64
    finite: bool  # loss and every gradient finite (a NaN or inf anywhere makes the norm one)
    calls: dict[str, list[int]]  # forward calls per decoder layer of "layer", "attn", "mlp" (recomputes included)
    recomputes: int  # sublayer (attention, MLP) forwards beyond one per micro-batch
    held_after_forward: int  # live bytes the forward added (allocator on CUDA, tracked storages on the CPU)
    saved_bytes: int  # bytes autograd saved outside any other saved-tensor hooks (offload, checkpointing)
    saved_tensors: int  # tensors it saved there


def probe(model, batch: dict, strategy: Strategy = PLAIN, *, entered: Entered | None = None, device=None,
          observers: Sequence[Observer] = ()) -> Probe:
    """The step without the update on the current weights: loss, gradients, forward calls, saved bytes.

    No update: every strategy's probe from the same weights gives loss and gradients that compare with
    the plain one exactly. The gradients are copied (on the device) and cleared.
    """
    device = torch.device(device or next(model.parameters()).device)
    marks = PeakMemory(device, resident=[model.parameters()])
    counter = SavedBytesCounter(model.parameters())

    @contextlib.contextmanager
    def watch(phase, state):
        if phase != "forward":
            yield
            return
        marks.mark("start")
        with counter:  # outermost: the offload's and checkpointing's own hooks, inside it, win
            yield
        marks.mark("after_forward")

    with ForwardCounter(model) as fc, marks:
        r = train_step(model, None, batch, strategy, entered=entered, observers=(watch, *observers), update=False)
    grads = [p.grad for p in model.parameters()]
    norm = global_grad_norm(grads, dtype=torch.float64).item()
    copies = [None if g is None else g.detach().clone() for g in grads]
    model.zero_grad(set_to_none=True)
    k, loss = strategy.micro_batches, r.loss.item()
    recomputes = sum(n - k for part in ("attn", "mlp") for n in fc.calls[part] if n)
    return Probe(loss, copies, norm, math.isfinite(loss) and math.isfinite(norm), fc.calls, recomputes,
                 marks.marks["after_forward"] - marks.marks["start"], counter.bytes, counter.tensors)
