"""Part 02 · 42 — TRAIN-OFFLOAD: saved activations moved to host memory between forward and backward.

Autograd's ``saved_tensors_hooks`` let a pack hook replace each tensor saved for backward by
anything, and an unpack hook give it back when backward needs it. ``ActivationOffload`` (style
after torchtune's ``training/_activation_offloading.py``) packs a device tensor into a host
buffer and unpacks it to the device again:

* parameters (and views of them) and tensors under ``min_bytes`` stay resident: a parameter lives
  on the device anyway, and a tiny copy costs more in launch latency than it frees;
* copies go per *storage*: views of one storage (``q``/``k`` slices, ``x.view(...)``) are moved and
  counted once, and rebuilt as views with their offset, size and stride;
* host buffers come from a reused pool (``HostPool``; pinned on CUDA), so from the second step on
  no host memory is allocated;
* on CUDA, device-to-host copies run on a side stream; compute runs at most ``inflight`` copies
  ahead before it waits (which bounds the device memory still waiting for its copy), and backward
  prefetches the next ``prefetch`` storages host-to-device on that stream;
* ``d2h_bytes`` / ``h2d_bytes`` count what the hooks really copy.

On the CPU there is no device: the "host" copy is a CPU clone into the pool and the copy back
is another clone, with no stream. Hooks, skip rules and byte counts are real; time says nothing
about a host link. The CPU storage tracker does not see the host side (pool buffers and
``save_on_cpu``'s host copies), as the CUDA allocator does not see pinned host memory, so the
CPU peak is what a device would hold; the host bytes are reported beside it.
"""

from __future__ import annotations

import contextlib
import statistics
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from bp_mech import checkpointing as ck
from bp_mech.experiments import harness
from bp_mech import counters
from bp_mech.measure import host_side
from bp_mech.workload import build_model, make_batches

CODE_MODULES = ("bp_mech.checkpointing", "bp_mech.experiments.harness")  # configure; step, probe, rule: hashed too


class HostPool:
    """Host buffers reused across steps, bucketed by exact byte size (pinned on CUDA)."""

    def __init__(self, pin: bool):
        self.pin = pin  # page-locked: needed for asynchronous copies
        self.free: dict[int, list] = defaultdict(list)  # nbytes -> idle uint8 buffers
        self.allocated = 0  # bytes ever allocated
        self.allocations = 0  # buffers ever allocated
        self.in_use = 0  # bytes handed out now
        self.high_water = 0  # most bytes handed out at once

    def take(self, n: int) -> torch.Tensor:
        if self.free[n]:
            buf = self.free[n].pop()
        else:
            with host_side():
                buf = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
            self.allocated, self.allocations = self.allocated + n, self.allocations + 1
        self.in_use += n
        self.high_water = max(self.high_water, self.in_use)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self.free[buf.numel()].append(buf)
        self.in_use -= buf.numel()


class _Slot:
    """One offloaded storage: its host copy, and its device copy while backward needs it."""

    def __init__(self, host, nbytes, version, forward, index):
        self.host, self.nbytes, self.version = host, nbytes, version
        self.forward, self.index = forward, index  # which forward packed it, at which position
        self.pending = 0  # packed views not unpacked yet
        self.dev = None  # device uint8 buffer (prefetched or in use), dropped when pending hits 0
        self.event = None  # CUDA event: the H2D copy into ``dev`` is done


@dataclass
class OffloadConfig:
    min_bytes: int = 2**20  # storages smaller than this stay resident
    side_stream: bool = True  # CUDA: copy on a side stream instead of the compute stream
    prefetch: int = 2  # CUDA: storages copied back ahead of backward's use
    inflight: int = 4  # CUDA: D2H copies the compute stream may run ahead of before it waits


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload activations to a reused host pool. Enter once per forward;
    the counters cover the last forward and its backward."""

    def __init__(self, params, cfg: OffloadConfig = OffloadConfig(), device="cpu"):
        self.params, self.cfg, self.device = list(params), cfg, torch.device(device)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda and cfg.side_stream else None
        self.pool = HostPool(pin=cuda)
        self._reset()
        super().__init__(self._pack, self._unpack)

    def _reset(self):
        self.d2h_bytes = self.h2d_bytes = 0  # bytes copied device -> host, host -> device
        self.offloaded = self.shared_views = self.kept_params = self.kept_small = 0  # saved tensors, by fate
        self.kept_small_bytes = 0
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        self._by_storage, self._order = {}, []  # data_ptr -> (weak storage, slot); slots in pack order
        self._forward = getattr(self, "_forward", 0) + 1  # counts forwards: prefetch stays within one
        self._stash = []  # CUDA: (device bytes, event) of D2H copies in flight, oldest first

    def __enter__(self):
        self._reset()
        return super().__enter__()

    def __exit__(self, *exc):
        self._drain(0)  # the end of forward: compute waits for the last copies, then they may be freed
        return super().__exit__(*exc)

    def _drain(self, keep: int) -> None:
        """Let the compute stream wait for all but ``keep`` in-flight D2H copies, then drop their sources.

        Dropped after the wait, a source block returns to the compute stream's pool and is reused only
        after the copy (stream order), with no ``record_stream``: memory stays deterministic and bounded.
        """
        while len(self._stash) > keep:
            _, event = self._stash.pop(0)
            torch.cuda.current_stream(self.device).wait_event(event)

    def _keep(self, t) -> bool:
        if (type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided or t.is_conj()
                or t.is_neg() or t.device.type != self.device.type):
            return True  # subclasses, sparse, lazy conj/neg views and foreign devices stay as they are
        st = t.untyped_storage()
        if isinstance(t, nn.Parameter) or st.data_ptr() in self._param_ptrs:
            self.kept_params += 1
            return True
        if st.nbytes() < self.cfg.min_bytes:
            self.kept_small, self.kept_small_bytes = self.kept_small + 1, self.kept_small_bytes + st.nbytes()
            return True
        return False

    def _pack(self, t):
        if self._keep(t):
            return t
        st = t.untyped_storage()
        ref, slot = self._by_storage.get(st.data_ptr(), (None, None))
        if slot is None or ref.expired() or slot.version != t._version:
            with host_side():
                slot = self._offload(st, t._version)
            self._by_storage[st.data_ptr()] = (StorageWeakRef(st), slot)
        else:
            self.shared_views += 1  # a view of a storage already on the host: nothing to copy
        slot.pending += 1
        self.offloaded += 1
        return slot, t.dtype, t.storage_offset(), t.size(), t.stride()

    def _offload(self, st, version) -> _Slot:
        host = self.pool.take(st.nbytes())
        src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)  # the storage as bytes
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer has finished
            with torch.cuda.stream(self.stream):
                host.copy_(src, non_blocking=self.pool.pin)
            self._stash.append((src, self.stream.record_event()))  # src stays alive until compute waited
            self._drain(self.cfg.inflight)
        else:
            host.copy_(src, non_blocking=self.pool.pin)
        self.d2h_bytes += st.nbytes()
        slot = _Slot(host, st.nbytes(), version, self._forward, len(self._order))
        weakref.finalize(slot, self.pool.give, host)  # back to the pool when autograd drops the slot
        self._order.append(slot)
        return slot

    def _fetch(self, slot: _Slot) -> None:
        if slot.dev is not None:
            return
        if self.stream is not None:
            with torch.cuda.stream(self.stream):  # after the D2H into slot.host on the same stream
                slot.dev = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
                slot.dev.copy_(slot.host, non_blocking=self.pool.pin)
                slot.event = torch.cuda.Event()
                slot.event.record(self.stream)
        else:
            slot.dev = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
            slot.dev.copy_(slot.host, non_blocking=self.pool.pin)
        self.h2d_bytes += slot.nbytes

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed  # kept resident
        slot, dtype, offset, size, stride = packed
        self._fetch(slot)
        buf = slot.dev
        if self.stream is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(slot.event)
            buf.record_stream(cur)  # allocated on the side stream, used by compute: freed after both
        depth = self.cfg.prefetch if self.stream is not None and slot.forward == self._forward else 0
        for k in range(slot.index - 1, -1, -1)[:depth]:
            if self._order[k].pending:
                self._fetch(self._order[k])  # backward runs roughly in reverse pack order
        slot.pending -= 1
        if slot.pending <= 0:
            slot.dev = None  # the returned view keeps the storage alive exactly as long as autograd needs it
        return torch.empty(0, dtype=dtype, device=buf.device).set_(buf.untyped_storage(), offset, size, stride)


def offload_activations(params, enabled: bool = True, cfg: OffloadConfig = OffloadConfig(), device="cpu"):
    """``ActivationOffload``, or ``contextlib.nullcontext()`` when off."""
    return ActivationOffload(params, cfg, device) if enabled else contextlib.nullcontext()


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """PyTorch's ``save_on_cpu(pin_memory=True)``, its hooks wrapped to count the bytes it copies.

    It copies every saved tensor (parameters and each view separately) on the compute stream. On
    the CPU its ``.to(device)`` returns the host tensor itself; the wrapper clones it there, to
    stand for the copy back a device would make.
    """

    def __init__(self):
        super().__init__(pin_memory=True, device_type="cuda")
        pack, unpack = self.pack_hook, self.unpack_hook
        self.d2h_bytes = self.h2d_bytes = 0

        def counted_pack(t):
            self.d2h_bytes += t.numel() * t.element_size()
            with host_side():
                return pack(t)

        def counted_unpack(packed):
            self.h2d_bytes += packed[1].numel() * packed[1].element_size()
            out = unpack(packed)
            return out.clone() if out is packed[1] else out

        self.pack_hook, self.unpack_hook = counted_pack, counted_unpack

    def __enter__(self):
        self.d2h_bytes = self.h2d_bytes = 0  # the counters cover the last forward and its backward
        return super().__enter__()


def measure_bandwidth(device, nbytes: int = 256 * 2**20, reps: int = 5) -> dict:
    """Pinned host <-> device copy bandwidth (bytes/s, median of ``reps``), CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = nbytes / statistics.median(times)
    return out


CANDIDATES = ("resident", "save_on_cpu", "offload", "offload-checkpoint")
# The seed's reference (RTX 5070 Ti, Qwen2.5-0.5B, b2s512): quoted as such, never as this book's run.
SEED_REFERENCE = dict(run_label="b2s512_default1", device="RTX 5070 Ti", model="Qwen2.5-0.5B",
                      peak_saving=0.343, median_ratio=5.87, decision="tune")
CPU_MIN_BYTES = 4096  # the tiny workload's activations are KiB-sized: a smaller threshold on the CPU
TIME_FACTOR = {"resident": 1.0, "save_on_cpu": 6.0, "offload": 1.5, "offload-checkpoint": 2.0}  # planning


def min_bytes(device) -> int:
    return OffloadConfig.min_bytes if torch.device(device).type == "cuda" else CPU_MIN_BYTES


def plan(ctx) -> dict:
    return dict(step="zero_grad + forward (under the candidate's hooks) + backward + AdamW update, interleaved",
                counting="1 counting-only saved_tensors_hooks forward per configuration (resident, checkpointed)",
                modes=harness.plan_modes(ctx.workload, TIME_FACTOR.values(), ctx.smoke, min_bytes=min_bytes,
                                    bandwidth=lambda d: "pinned H2D/D2H, 256 MiB x 5" if d == "cuda" else None),
                estimate_basis=f"as Part 02 · 19's, with TIME_FACTOR {TIME_FACTOR}",
                rule=dict(MIN_PEAK_SAVING=harness.MIN_PEAK_SAVING, MAX_TIME_RATIO=harness.MAX_TIME_RATIO,
                          MIN_USEFUL_SAVING=harness.MIN_USEFUL_SAVING))


def count_saved(model, batch, candidate="plain") -> counters.SavedBytesCounter:
    """What autograd saves in one forward (counting only), with the given checkpointing."""
    counter = counters.SavedBytesCounter(model.parameters())
    with ck.configure(model, candidate), counter:
        model(**batch).loss  # the graph is dropped at once; nothing is moved
    return counter


def make_hooks(name: str, model, cfg: OffloadConfig, device):
    """The saved-tensor hooks of a candidate (None: resident)."""
    if name == "save_on_cpu":
        return CountingSaveOnCpu()
    return ActivationOffload(model.parameters(), cfg, device) if name.startswith("offload") else None


def hook_stats(h) -> dict:
    """What the hooks counted in the last step, as plain numbers (the hooks and their pool can go)."""
    out = dict(d2h=h.d2h_bytes, h2d=h.h2d_bytes)
    if isinstance(h, ActivationOffload):
        out.update(kept_small_bytes=h.kept_small_bytes, kept_param_saves=h.kept_params, shared_views=h.shared_views,
                   offloaded_tensors=h.offloaded, host_pool_bytes=h.pool.allocated,
                   host_peak_bytes=h.pool.high_water, pool_allocations=h.pool.allocations)
    else:
        out.update(host_peak_bytes=h.d2h_bytes)  # save_on_cpu holds every copy until backward
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        # the CUDA caching host allocator's own view of pinned memory, beside the pool's counters
        out["cuda_host_memory_stats"] = {k: v for k, v in torch.cuda.host_memory_stats().items()
                                         if isinstance(v, (int, float))}
    return out


def link_metrics(d2h: int, h2d: int, bandwidth: dict, median_s: float, base_median_s: float) -> dict:
    """The transfer bound (bytes / measured bandwidth, nothing overlapped) against the step-time overhead
    over the resident run; what exceeds the bound is, at least, the implementation's."""
    bound = d2h / bandwidth["d2h"] + h2d / bandwidth["h2d"]
    over = median_s - base_median_s
    return dict(bandwidth_bytes_per_s=bandwidth, transfer_bound_s=bound, overhead_s=over,
                overhead_over_bound=over / bound if bound else None, implementation_s=max(0.0, over - bound))


def run(ctx, bandwidth: dict | None = None) -> list:
    """Every candidate; ``bandwidth`` ({"h2d", "d2h"} bytes/s) is measured on CUDA when not given."""
    dev = ctx.device
    model = build_model(ctx.workload, dev)
    batches = make_batches(ctx.workload, 4, device=dev)
    counts = {c: count_saved(model, batches[0], c) for c in ("plain", "checkpoint-all")}
    bw = bandwidth or (measure_bandwidth(dev) if torch.device(dev).type == "cuda" else None)
    cfg = OffloadConfig(min_bytes=min_bytes(dev))
    hooks = {name: make_hooks(name, model, cfg, dev) for name in CANDIDATES}
    checkpointed = lambda: ck.configure(model, "checkpoint-all")  # noqa: E731
    candidates = {name: harness.Candidate(setup=checkpointed if name == "offload-checkpoint" else contextlib.nullcontext,
                                     saving=hooks[name]) for name in CANDIDATES}
    results = harness.measure_candidates(model, batches, dev, candidates, progress=ctx.progress, smoke=ctx.smoke)
    for name, (r, _) in results.items():
        if hooks[name] is not None and r is not None:  # the counters of their last step (the probe)
            r["hooks"] = hook_stats(hooks[name])
    del hooks, candidates  # frees the host pools
    base = results["resident"][0]

    def extra(name, r):
        m = dict(saved_activation_bytes=counts["plain"].bytes, saved_tensors=counts["plain"].tensors,
                 saved_tensor_bytes_per_tensor=counts["plain"].tensor_bytes)
        if name == "resident":
            return {}, m
        h = dict(r["hooks"])
        t = dict(d2h=h.pop("d2h"), h2d=h.pop("h2d"))
        # what the counting pass predicts: distinct storages >= min_bytes for ours; every saved
        # tensor (parameters and views included) for save_on_cpu
        c = counts["checkpoint-all" if name == "offload-checkpoint" else "plain"]
        expected = c.tensor_bytes if name == "save_on_cpu" else c.bytes_at_least(cfg.min_bytes)
        m.update(h, expected_d2h_bytes=expected, d2h_matches_count=t["d2h"] == expected,
                 saved_outside_checkpoint_bytes=counts["checkpoint-all"].bytes, min_bytes=cfg.min_bytes)
        if bw is not None and base is not None:
            m.update(link_metrics(t["d2h"], t["h2d"], bw, r["timing"].median_s, base["timing"].median_s))
        return {"transfer_bytes": t}, m

    return harness.make_records(ctx, results, "resident", extra)


def conformance():
    """Our offload vs PyTorch's ``save_on_cpu`` and the resident run: same loss and gradients;
    our D2H bytes equal the independently counted saved-activation bytes."""
    from bp_mech.registry import ConformanceRow
    from bp_mech.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    model, batch = build_model(w), make_batches(w, 1)[0]
    counted = count_saved(model, batch).bytes_at_least(CPU_MIN_BYTES)
    off = ActivationOffload(model.parameters(), OffloadConfig(min_bytes=CPU_MIN_BYTES))
    soc = CountingSaveOnCpu()
    ref, ours, torch_ = (harness.probe(model, batch, "cpu", h) for h in (None, off, soc))
    worst = max(max(e["loss_error"], e["grad_error"]) for e in (harness.compare(ref, ours), harness.compare(ref, torch_)))
    ok = worst == 0.0 and off.d2h_bytes == counted and off.d2h_bytes <= soc.d2h_bytes
    return ConformanceRow("Part 02 · 42", "TRAIN-OFFLOAD", "torch.autograd.graph.save_on_cpu + resident autograd", ok,
                          f"max loss/grad rel. error {worst:.1e} (tol 0, float32 CPU); D2H {off.d2h_bytes} B vs "
                          f"counted saved activations {counted} B; save_on_cpu copies {soc.d2h_bytes} B")
