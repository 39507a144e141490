"""Checks of exercises/ex43_state_ledger.py, part two: the whole contract, explored, and the two new exercises.

- ``check_<f>__contract``: on Qwen2 shapes and dtypes *drawn* by hypothesis (``properties.explore`` over
  ``POOL``: one head, multi-head, grouped-query and multi-query attention, head dims 2-8, odd sizes, 1-2
  layers, tied or not; float64, float32, bfloat16, float16), the count equals what a real model allocates, it is exactly an ``int``, and
  the config is left as it was (compared attribute by attribute, ``cfg.to_dict()``).
- ``gelu_mlp_saved_bytes`` (variant): measured on ``torch.nn`` modules through ``saved_tensors_hooks``,
  distinct storages, weights left out; drawn shapes, dtypes, GELU approximations and biases.
- ``predict_forward_bytes`` (predict, then measure): a real steady-state CPU step of configs the chapter did
  not show (``planner.lifecycle.track``), its "after forward" total within ``PREDICT_TOL``.
"""

from __future__ import annotations

import functools

import torch
from hypothesis import strategies as st

from bp_mech.checks import ex43_measure as measure
from bp_mech.checks.common import call
from bp_mech.checks.properties import assert_type, explore

DTYPES = [(torch.float64, 8), (torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)]
PREDICT_TOL = 0.02  # the lines the prediction leaves out are < 1 % at PREDICT_CASES; each line it keeps is > 2 %
PREDICT_CASES = [((24, 2, 2, 48, 320, 1, True), 4, 24), ((40, 5, 1, 96, 200, 3, False), 3, 20),
                 ((80, 4, 1, 8, 24, 1, True), 16, 8)]  # the last: the final norm's saves are 16 % of the total


# (hidden, heads, kv heads, intermediate, vocab, layers, tied), as ``ex43.SHAPES``: one query head, plain
# multi-head, grouped-query, multi-query, head dims 2 to 8, odd sizes, tied and untied, one and two layers.
# A fixed pool, so that shrinking a failure reuses the measured models (``measure_state`` is cached).
POOL = [(2, 1, 1, 3, 5, 1, True), (8, 2, 2, 9, 11, 1, False), (12, 3, 1, 20, 7, 2, True), (16, 4, 2, 24, 33, 1, True),
        (16, 2, 1, 5, 17, 2, False), (24, 3, 3, 40, 29, 1, False), (32, 4, 4, 13, 64, 2, True),
        (8, 4, 1, 16, 3, 1, True), (6, 1, 1, 31, 40, 2, False), (24, 4, 2, 7, 50, 1, False)]


def qwen2_shapes():
    return st.sampled_from(POOL)


def _changed(before: dict, after: dict) -> str | None:
    diff = [f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in sorted(set(before) | set(after))
            if before.get(k) != after.get(k)]
    return ", ".join(diff[:3]) or None


def call_int(fn: str, f, cfg, *args, at: str) -> int:
    """``f(cfg, *args)``: exactly an ``int``, ``cfg`` unchanged (``cfg`` None: no config to compare)."""
    before = cfg.to_dict() if cfg is not None else None
    got = call(fn, f, *(() if cfg is None else (cfg,)), *args, at=at)
    if cfg is not None and (what := _changed(before, cfg.to_dict())):
        raise AssertionError(f"{fn}: cfg was modified ({what}); the config is shared by the model and the run "
                             f"at {at}")
    assert_type(fn, "the byte count", got, int, at)
    return got


def predicted_within(fn: str, f, shape, batch: int, seq: int, measured, tol: float, what: str) -> None:
    """``f(config of shape, batch, seq)`` (``call_int``) within ``tol``, relative, of ``measured()`` (called after
    it: a stub costs no measurement); ``what``: the measurement in words, ``{want}`` where its bytes go."""
    at = measure.describe_shape(shape, f"; batch {batch}, seq {seq}")
    got = call_int(fn, f, measure.shape_config(shape), batch, seq, at=at)
    want = measured()
    err = got / want - 1
    assert abs(err) <= tol, (f"{fn}: predicted {got} bytes, {what.format(want=want)} ({err:+.1%}, tolerance "
                             f"{tol:.0%}) at {at}")


def _state_contract(m, fn: str, index: int, dtypes):
    def body(case):
        shape, (dtype, nb) = case
        at = measure.describe_dtype(shape, dtype, nb)
        got = call_int(fn, getattr(m, fn), measure.shape_config(shape), nb, at=at)
        want = measure.measure_state(shape, dtype)[index]
        assert got == want, f"{fn}: {got} bytes, PyTorch allocates {want} ({got - want:+d}) at {at}"

    explore(st.tuples(qwen2_shapes(), st.sampled_from(dtypes)), body)


def check_param_bytes__contract(m):
    _state_contract(m, "param_bytes", 0, DTYPES)


def check_grad_bytes__contract(m):
    _state_contract(m, "grad_bytes", 1, DTYPES)


def check_adam_state_bytes__contract(m):
    _state_contract(m, "adam_state_bytes", 2, DTYPES)


def check_block_saved_bytes__contract(m):
    def body(case):
        shape, B, T = case
        at = measure.describe_shape(shape, f"; batch {B}, seq {T}")
        got = call_int("block_saved_bytes", m.block_saved_bytes, measure.shape_config(shape), B, T, at=at)
        want = _block(shape, B, T)
        assert got == want, f"block_saved_bytes: {got} bytes, PyTorch saves {want} ({got - want:+d}) at {at}"

    explore(st.tuples(qwen2_shapes(), st.integers(1, 3), st.sampled_from([1, 2, 5, 8, 13])), body)


@functools.cache
def _block(shape, B: int, T: int) -> int:
    return measure.measure_block_saved_bytes(measure.shape_config(shape), B, T)


# --- Exercise 43.5 (variant): the ledger of a GELU MLP ----------------------------------


@functools.cache
def measure_gelu_mlp_saved_bytes(C: int, I: int, B: int, T: int, dtype=torch.float32, approximate="none",
                                 bias=True) -> int:
    """Distinct storages ``Linear(C, I) -> GELU -> Linear(I, C)`` hands to ``saved_tensors_hooks``, weights
    and biases left out."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(C, I, bias=bias), torch.nn.GELU(approximate=approximate),
                              torch.nn.Linear(I, C, bias=bias)).to(dtype).train()
    x = torch.randn(B, T, C, dtype=dtype, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mlp(x)
    assert y.shape == x.shape
    return sum(saved.values())


def _gelu_at(C, I, B, T, dtype, nb, approximate="none", bias=True):
    return (f"hidden {C}, intermediate {I}, batch {B}, seq {T}; {str(dtype)[6:]}, bytes_per_value={nb}, "
            f"GELU approximate={approximate!r}, bias={bias}")


def check_gelu_mlp_saved_bytes(m):
    for (C, I, B, T), (dtype, nb) in zip([(8, 20, 2, 3), (16, 64, 1, 5), (12, 7, 3, 4), (4, 4, 1, 1)],
                                         [DTYPES[1], DTYPES[2], DTYPES[0], DTYPES[3]]):
        at = _gelu_at(C, I, B, T, dtype, nb)
        got = call_int("gelu_mlp_saved_bytes", m.gelu_mlp_saved_bytes, None, C, I, B, T, nb, at=at)
        want = measure_gelu_mlp_saved_bytes(C, I, B, T, dtype)
        assert got == want, (f"gelu_mlp_saved_bytes: {got} bytes, the torch.nn modules save {want} ({got - want:+d})"
                             f" at {at}")
    at = _gelu_at(8, 20, 2, 3, torch.float32, 4).replace("bytes_per_value=4", "bytes_per_value left at its default")
    got = call_int("gelu_mlp_saved_bytes", m.gelu_mlp_saved_bytes, None, 8, 20, 2, 3, at=at)
    want = measure_gelu_mlp_saved_bytes(8, 20, 2, 3, torch.float32)
    assert got == want, (f"gelu_mlp_saved_bytes: {got} bytes, the torch.nn modules save {want} ({got - want:+d}); "
                         f"the default bytes_per_value is 4 (float32) at {at}")


def check_gelu_mlp_saved_bytes__contract(m):
    def body(case):
        (C, I, B, T), (dtype, nb), approximate, bias = case
        at = _gelu_at(C, I, B, T, dtype, nb, approximate, bias)
        got = call_int("gelu_mlp_saved_bytes", m.gelu_mlp_saved_bytes, None, C, I, B, T, nb, at=at)
        want = measure_gelu_mlp_saved_bytes(C, I, B, T, dtype, approximate, bias)
        assert got == want, (f"gelu_mlp_saved_bytes: {got} bytes, the torch.nn modules save {want} ({got - want:+d})"
                             f" at {at}")

    sizes = st.tuples(st.integers(1, 24), st.integers(1, 48), st.integers(1, 3), st.integers(1, 6))
    explore(st.tuples(sizes, st.sampled_from(DTYPES), st.sampled_from(["none", "tanh"]), st.booleans()), body)


# --- Exercise 43.6 (predict, then measure): the "after forward" line of a new config ------


@functools.cache
def measure_forward_bytes(shape, batch: int, seq: int) -> int:
    """The "after forward" total of a real steady-state plain float32 step on the CPU (the chapter's tracker)."""
    from bp_mech.planner import lifecycle
    from bp_mech.planner.build import ConfigWorkload
    return lifecycle.track(ConfigWorkload(measure.shape_config(shape), batch, seq)).total("forward")


def check_predict_forward_bytes(m):
    for shape, B, T in PREDICT_CASES:
        predicted_within("predict_forward_bytes", m.predict_forward_bytes, shape, B, T,
                         lambda: measure_forward_bytes(shape, B, T), PREDICT_TOL,
                         "a real step holds {want} after its forward")


CHECKS = [check_param_bytes__contract, check_grad_bytes__contract, check_adam_state_bytes__contract,
          check_block_saved_bytes__contract, check_gelu_mlp_saved_bytes, check_gelu_mlp_saved_bytes__contract,
          check_predict_forward_bytes]
