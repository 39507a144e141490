"""Checks of exercises/ex42_offload.py: one declaration per class or function (``engine.Contract``).

``CountingOffload`` and ``BudgetOffload`` are graded by scenarios (``ex42_measure.scenarios``): a driver runs the
hooks as a reader would and returns what it sees; the reference gives what the docstring promises, from plain
float64 autograd, counting-only ``saved_tensors_hooks`` written here (distinct non-parameter storages, each
once), weak references (a packed object must not keep the original storage alive) and the rules themselves. The
domains: parameters as a list and as a generator, one frozen, and their views; the size rule exactly at
``min_bytes``, under it, at a non-default one, at the default (uint8 storages of 1024 and 1023 B), on a
two-element view of a large storage, in bfloat16 and float16 (bytes, not elements); views of one storage; a
second unpack after the first one's result was written; a storage rewritten in place between two packs, a new
storage at a freed one's address, a version counter past 256. Never the answer file. The variant and the
prediction: ``ex42_variant``, ``ex42_measure``.
"""

import array
import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bp_mech.checks.engine import Contract, checks
from bp_mech.checks.ex42_measure import (MIN_BYTES, PREDICT, lifecycle, lifecycle_ref, plain_grads, saved_storages,
                                          scenarios, toy_params, toy_step, within)
from bp_mech.checks.ex42_variant import BUDGET_OFFLOAD


def _counted(seed):
    """(bytes one toy forward moves, twice the per-tensor bytes: the most two backwards may copy back)."""
    distinct, per = saved_storages(seed)
    return sum(n for n in distinct if n >= MIN_BYTES), sum(n for n in per if n >= MIN_BYTES)


def _step(cls, seed, as_generator):
    hooks, first, second = toy_step(lambda p: cls(p, MIN_BYTES), seed, as_generator)
    once, per = _counted(seed)
    return {"gradients of the first backward": first, "gradients of the second backward": second,
            "d2h_bytes": hooks.d2h_bytes, "h2d_bytes after two backwards": within(hooks.h2d_bytes, 2 * once, 2 * per)}


def _step_ref(seed, as_generator):
    once, per = _counted(seed)
    return {"gradients of the first backward": plain_grads(seed), "gradients of the second backward": plain_grads(seed),
            "d2h_bytes": once, "h2d_bytes after two backwards": within(2 * once, 2 * once, 2 * per)}


def _parameters(cls, as_generator):
    params, _, _ = toy_params(2)
    params[2].requires_grad_(False)  # a frozen parameter is still a parameter
    hooks = cls((p for p in params) if as_generator else params, MIN_BYTES)
    copies = []
    for i, W in enumerate(params):
        for kind, v in (("itself", W), ("detached", W.detach()), ("a flat view", W.view(-1)), ("transposed", W.t())):
            if hooks.unpack(hooks.pack(v)) is not v:
                copies.append(f"parameter {i} ({kind})")
    return {"parameters that came back as copies": copies, "d2h_bytes": hooks.d2h_bytes, "h2d_bytes": hooks.h2d_bytes}


def _parameters_ref(as_generator):
    return {"parameters that came back as copies": [], "d2h_bytes": 0, "h2d_bytes": 0}


def _min_bytes(cls, t, min_bytes):
    hooks = cls([]) if min_bytes is None else cls([], min_bytes)
    out = hooks.unpack(hooks.pack(t))
    moved = out is not t
    return {"moved": moved, "d2h_bytes": hooks.d2h_bytes, "h2d_bytes": hooks.h2d_bytes,
            "the unpacked tensor": out if moved else None, "its stride": out.stride() if moved else None}


def _min_bytes_ref(t, min_bytes):
    n = t.untyped_storage().nbytes()
    moved = n >= (MIN_BYTES if min_bytes is None else min_bytes)
    return {"moved": moved, "d2h_bytes": n if moved else 0, "h2d_bytes": n if moved else 0,
            "the unpacked tensor": t.clone() if moved else None, "its stride": t.stride() if moved else None}


def _fresh(dtype):
    return (torch.randn(64, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 2).to(dtype)


def _freed(cls, dtype):
    hooks, big = cls([], MIN_BYTES), _fresh(dtype)
    ref = StorageWeakRef(big.untyped_storage())
    packed = hooks.pack(big)
    del big
    gc.collect()
    freed = ref.expired()
    out = hooks.unpack(packed)
    return {"the original storage freed after pack": freed, "the unpacked tensor": out, "its dtype": str(out.dtype),
            "d2h_bytes": hooks.d2h_bytes, "h2d_bytes": hooks.h2d_bytes}


def _freed_ref(dtype):
    t = _fresh(dtype)
    n = t.untyped_storage().nbytes()
    return {"the original storage freed after pack": True, "the unpacked tensor": t, "its dtype": str(dtype),
            "d2h_bytes": n, "h2d_bytes": n}


def _views_of(base):
    return [base[:, :32], base.view(-1), base.t(), base[5:]]


def _views(cls, base):
    hooks = cls([], MIN_BYTES)
    packed = [hooks.pack(v) for v in _views_of(base)]
    d2h, outs = hooks.d2h_bytes, [hooks.unpack(p) for p in packed]
    return {"d2h_bytes": d2h, "the unpacked views": outs, "their strides": [o.stride() for o in outs]}


def _views_ref(base):
    return {"d2h_bytes": base.untyped_storage().nbytes(), "the unpacked views": [v.clone() for v in _views_of(base)],
            "their strides": [v.stride() for v in _views_of(base)]}


def _twice(cls, t):
    hooks = cls([], MIN_BYTES)
    packed = hooks.pack(t)
    hooks.unpack(packed).mul_(-3.0)  # backward may write into what it unpacked: the next unpack needs a fresh copy
    return {"a second unpack, after the first one's result was written in place": hooks.unpack(packed),
            "h2d_bytes": hooks.h2d_bytes}


def _twice_ref(t):
    return {"a second unpack, after the first one's result was written in place": t.clone(),
            "h2d_bytes": 2 * t.untyped_storage().nbytes()}


def _storages(cls, kind):
    hooks = cls([], MIN_BYTES)
    if kind == "rewritten":  # each pack saves the values it saw
        t = torch.randn(32, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        hooks.pack(t)
        t.mul_(-3.0)
        return {"the second pack, unpacked": hooks.unpack(hooks.pack(t))}
    if kind == "address reused":  # an allocator reuses freed memory: the address alone does not tell a storage
        buf = bytearray(array.array("d", [1.0] * 512).tobytes())
        old = torch.frombuffer(buf, dtype=torch.float64)
        first, ref = hooks.pack(old), StorageWeakRef(old.untyped_storage())
        del old
        gc.collect()
        freed = ref.expired()
        buf[:] = array.array("d", [2.0] * 512).tobytes()
        second = hooks.pack(torch.frombuffer(buf, dtype=torch.float64))
        return {"the first storage freed after pack": freed, "the new storage, unpacked": hooks.unpack(second),
                "the freed storage, unpacked": hooks.unpack(first), "d2h_bytes": hooks.d2h_bytes}
    t = torch.zeros(32, 32, dtype=torch.float64)  # a version counter past Python's small-int cache: compare with ==
    for _ in range(300):
        t.add_(1.0)
    packed = [hooks.pack(v) for v in (t, t.view(-1), t[3:])]
    return {"d2h_bytes": hooks.d2h_bytes, "the unpacked views": [hooks.unpack(p) for p in packed]}


def _storages_ref(kind):
    if kind == "rewritten":
        return {"the second pack, unpacked": -3 * torch.randn(32, 32, generator=torch.Generator().manual_seed(6),
                                                              dtype=torch.float64)}
    if kind == "address reused":
        return {"the first storage freed after pack": True,
                "the new storage, unpacked": torch.full((512,), 2.0, dtype=torch.float64),
                "the freed storage, unpacked": torch.ones(512, dtype=torch.float64), "d2h_bytes": 2 * 4096}
    t = torch.full((32, 32), 300.0, dtype=torch.float64)
    return {"d2h_bytes": 8192, "the unpacked views": [t, t.view(-1), t[3:]]}


def _given(c):
    g = torch.Generator().manual_seed(c.get("seed", 0))
    s = c["scenario"]
    if s == "min_bytes":
        t = torch.randint(0, 256, (c["n"],), generator=g, dtype=torch.uint8) if c["dtype"] == torch.uint8 else \
            torch.randn(c["n"], generator=g, dtype=torch.float64).to(c["dtype"])
        if c.get("view"):
            t = torch.randn(64, 64, generator=g, dtype=torch.float64)[3, 5:7]
        return {"scenario": s, "given": {"t": t, "min_bytes": c["min_bytes"]}}
    if s in ("views", "twice", "lifecycle"):
        t = torch.randn(*((32, 64) if s == "views" else (64, 64) if s == "lifecycle" else (32, 32)), generator=g,
                        dtype=torch.float64)
        return {"scenario": s, "given": {"base" if s == "views" else "t": (t + 1).to(c.get("dtype", torch.float64))}}
    return {"scenario": s, "given": {k: v for k, v in c.items() if k not in ("scenario", "what")}}


def _mb(n, dtype, min_bytes, what, **more):
    return {"scenario": "min_bytes", "n": n, "dtype": dtype, "min_bytes": min_bytes, "what": what, **more}


COUNTING_OFFLOAD = Contract(
    "CountingOffload", _given, outs=("the run",), strides=False, tol=1e-12,
    ref_name="the reference (plain float64 autograd, counting-only hooks, the rules)",
    note=lambda c: c.get("what") or {"step": "the toy forward (float64), then two backwards",
                                     "lifecycle": f"min_bytes {MIN_BYTES}: pack, two instances, two forwards, a with "
                                                  "block that raises"}.get(c["scenario"], ""),
    **scenarios({"step": (_step, _step_ref), "parameters": (_parameters, _parameters_ref),
                 "min_bytes": (_min_bytes, _min_bytes_ref), "freed": (_freed, _freed_ref),
                 "views": (_views, _views_ref), "twice": (_twice, _twice_ref), "storages": (_storages, _storages_ref),
                 "lifecycle": (lambda cls, t: lifecycle(lambda p: cls(p, MIN_BYTES), t, "CountingOffload"),
                               lambda t: lifecycle_ref(_counted(4)[0]))}),
    examples={"": [{"scenario": "step", "seed": 0, "as_generator": False},
                   {"scenario": "step", "seed": 3, "as_generator": True}],
              "parameters": [{"scenario": "parameters", "as_generator": g} for g in (False, True)],
              "min_bytes": [_mb(10, torch.float64, MIN_BYTES, "an 80 B float64 tensor"),
                            _mb(128, torch.float64, MIN_BYTES, "a float64 tensor of exactly min_bytes (1024 B)"),
                            _mb(127, torch.float64, MIN_BYTES, "a float64 tensor 8 B under min_bytes"),
                            _mb(512, torch.bfloat16, MIN_BYTES, "a bfloat16 tensor of 512 elements = 1024 B"),
                            _mb(511, torch.float16, MIN_BYTES, "a float16 tensor of 511 elements = 1022 B"),
                            _mb(300, torch.float16, MIN_BYTES, "a float16 tensor of 600 B (300 elements)"),
                            _mb(2, torch.float64, MIN_BYTES, "a 2-element view of a 32 KiB storage (the rule is per "
                                                             "storage)", view=True),
                            _mb(256, torch.float64, 4096, "a 2 KiB tensor under min_bytes=4096"),
                            _mb(2048, torch.bfloat16, 4096, "a 4 KiB bfloat16 tensor at min_bytes=4096"),
                            _mb(1024, torch.uint8, None, "a uint8 tensor of 1024 B, min_bytes left out"),
                            _mb(1023, torch.uint8, None, "a uint8 tensor of 1023 B, min_bytes left out")],
              "storage_freed": [{"scenario": "freed", "dtype": d} for d in (torch.float64, torch.bfloat16)],
              "views": [{"scenario": "views", "dtype": d, "what": f"four views of one {str(d)[6:]} storage"}
                        for d in (torch.float64, torch.float16)],
              "unpacked_twice": [{"scenario": "twice", "what": "one 8 KiB tensor packed once, unpacked twice (a "
                                                               "retained graph's second backward)"}],
              "storages": [{"scenario": "storages", "kind": k} for k in ("rewritten", "address reused", "old version")],
              "contract": [{"scenario": "lifecycle"}]})

CHECKS = checks(COUNTING_OFFLOAD, BUDGET_OFFLOAD, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex42.check_CountingOffload__min_bytes, ...
