"""`--vamp-staging host` on a GPU (issue 49): the cold experts' tokens cross to the host and back around the
layer's MoE kernel, in two eager graph breaks, while the device runs the resident experts.

On the CPU (host_experts.py) the split and the host half run before the kernel. On a GPU the split needs
the router's ids on the host, a sync a captured graph cannot hold, so the layer's `run_moe_core` becomes
break, kernel, break, each break SGLang's `eager_on_graph` (moe_staging.py explains the breakable graphs
VAMP runs decode under; eager forwards take the same breaks as plain calls):

1. `send` (where whole or routed staging would take its break): on the compute stream, snapshot the
   hidden rows, ids and weights into fixed device buffers, then mask the cold slots in place (id -1, the
   id SGLang's Triton MoE skips: "padding and nonlocal routes both use -1, including without EP",
   kernels/ops/moe/fused_moe_triton_kernels.py:192, the unquantised kernel's -1 branch :462-477; weight
   0); record `ready`; on a side stream wait for it and copy the snapshot to pinned host buffers,
   non_blocking, one event after the copies.
2. The captured segment between the breaks replays the layer's kernel over the masked ids: the resident
   experts run on the device.
3. `add` (right after the kernel was issued, before anything reads its output): the CPU waits on the D2H
   event only, computes the cold pairs from the host copies with CPU mode's `cold_output` (the same code),
   into a pinned buffer; if any pair was cold, copies it to a device buffer on the side stream
   (non_blocking, one event), and the compute stream waits for that event and adds it to the kernel's
   output. The CPU's matmuls overlap the kernel enqueued before this break.

This is the submit / GPU experts / sync order of SGLang's KTransformers wrapper (layers/moe/kt_ep_wrapper.py
`KTEPWrapperMethod.apply`, which masks CPU experts as -1 the same way), with plain torch on the host and
every rank computing its own shard (the all-reduce adds the halves, as on the CPU).

Ordering, following the CUDA semantics torch documents (streams, events, pinned non_blocking copies):
nothing the side stream copies is written by the compute stream after `ready`; a pinned buffer is read
by the host only after the event of the copy that filled it, and refilled only after the copy that read
it finished: the D2H of layer L+1 queues on the side stream behind the H2D of layer L, so waiting for
it also covers that H2D before `out_host` is overwritten. Buffers are allocated once and reused; they
grow (powers of two of the token count) only after the side stream went idle.

Never run on a GPU so far (the first lent machine had none of this); eval/gpu_sections/host_experts_graph.py
runs it in captured segments and times each part. The whole token rows cross (no host read to compact
them): T x hidden x 2 bytes, 256 KiB at batch 64 and hidden 2048. Only the step's real rows: a graph
replayed at a larger batch routes its padding rows like tokens under plain TP, so `send` takes the real
token count from the staging engine (`StagingEngine.real_tokens`, the count routed staging trims to) and
snapshots, copies, computes and counts rows [:T] only; the padding rows' cold slots are masked with the
rest, so their (discarded) output is the resident kernel's.

`--enable-fused-moe-sum-all-reduce` (SGLang's Triton MoE then sums the top-k slots with atomic adds into
the [tokens, hidden] output, fused_moe.py:634-640, 888-891) is safe with the -1 slots: the sort puts
them in blocks of their own (bucket id + 1 = 0, expert id -1: kernels/jit/csrc/moe/moe_align_kernel.cu:59,
370), and such a block returns before writing anything when FUSE_SUM_ALL_REDUCE is set
(kernels/ops/moe/fused_moe_triton_kernels.py:462-477); the slot-indexed zeros it writes otherwise go to
the [tokens x k] intermediates. The kernel that writes them unconditionally (`fused_moe_kernel_gptq_awq`,
:186-205) runs only for INT4/INT8 weight-only experts, which refuse the fused sum (:987-989) and which
`host_refusal` refuses.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from vamp_sglang.integration.staging.host_experts import HostExpertStats, cold_output
from vamp_sglang.memory.experts import ExpertStore

MIN_TOKENS = 16  # the smallest buffer, in token rows
SYS_CPU = Path("/sys/devices/system/cpu")  # Linux's CPU topology (sysfs)


class HostCaptureError(RuntimeError):
    """The host round trip was reached inside a CUDA graph capture that would not replay it."""


class Copies(Protocol):
    """What the round trip needs from the device: buffers, the two copies and their events."""

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def refuse_capture(self) -> None: ...
    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None: ...
    def wait_host(self) -> None: ...
    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def idle(self) -> None: ...


class CudaCopies:
    """One side stream for both directions, pinned host buffers, and the events that order them.
    `timed`: also timing events around each direction's copies (gpu_check reads `copy_ms`)."""

    def __init__(self, device: torch.device, timed: bool = False) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.ready, self.host_done, self.device_done = (torch.cuda.Event() for _ in range(3))
        self._timers = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if timed else None
        self._copied_back = False  # whether the last round trip had an H2D copy (some pair was cold)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def refuse_capture(self) -> None:
        """A break body runs outside any capture (a breakable capture ends its segment first); inside a
        plain capture it would run once and never again, leaving the cold slots to nobody."""
        if torch.cuda.is_current_stream_capturing():
            raise HostCaptureError("--vamp-staging host reached inside a CUDA graph capture that replays no "
                                   "eager break: use breakable or disabled CUDA graphs")

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After everything the compute stream queued so far, copy each (pinned dst, device src) on the
        side stream; one event marks them all done."""
        self._copied_back = False
        self.ready.record(torch.cuda.current_stream(self.device))
        self.side.wait_event(self.ready)
        with torch.cuda.stream(self.side):
            self._time(0)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            self._time(1)
        self.host_done.record(self.side)

    def wait_host(self) -> None:
        """The one host wait: until the D2H copies are done (and with them every earlier side copy)."""
        self.host_done.synchronize()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy pinned `src` to `dst` on the side stream; the compute stream waits for it before its next
        kernel (the add)."""
        self._copied_back = True
        with torch.cuda.stream(self.side):
            self._time(2)
            dst.copy_(src, non_blocking=True)
            self._time(3)
        self.device_done.record(self.side)
        torch.cuda.current_stream(self.device).wait_event(self.device_done)

    def idle(self) -> None:
        self.side.synchronize()

    def copy_ms(self) -> tuple[float, float]:
        """The last round trip's D2H and H2D copy times, 0 for an H2D it did not need (timed only;
        synchronises the side stream)."""
        self.idle()
        h2d = self._timers[2].elapsed_time(self._timers[3]) if self._copied_back else 0.0
        return self._timers[0].elapsed_time(self._timers[1]), h2d

    def _time(self, i: int) -> None:
        if self._timers is not None:
            self._timers[i].record(self.side)


@dataclass
class _Buffers:
    """The fixed buffers of one shape: device snapshots and result, pinned host copies and result."""

    rows: int
    device_x: torch.Tensor
    device_ids: torch.Tensor
    device_weights: torch.Tensor
    device_out: torch.Tensor
    host_x: torch.Tensor
    host_ids: torch.Tensor
    host_weights: torch.Tensor
    host_out: torch.Tensor

    def fits(self, tokens: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> bool:
        return (tokens <= self.rows and x.shape[1:] == self.device_x.shape[1:]
                and ids.shape[1:] == self.device_ids.shape[1:] and x.dtype == self.device_x.dtype
                and ids.dtype == self.device_ids.dtype and weights.dtype == self.device_weights.dtype)


def physical_cores(cpus: Iterable[int]) -> int:
    """The physical cores under these logical CPUs: hyperthread siblings share one core's units, so they
    count once (by each CPU's sibling list in sysfs, `topology/core_cpus_list`, older kernels'
    `thread_siblings_list`); a CPU whose topology cannot be read counts as a core of its own."""
    cores = set()
    for cpu in cpus:
        topology = SYS_CPU / f"cpu{cpu}" / "topology"
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                cores.add((topology / name).read_text().strip())
                break
            except OSError:
                continue
        else:
            cores.add(f"cpu{cpu}")
    return len(cores)


def host_threads(ranks_bound: bool = False) -> int:
    """Intra-op threads for this rank's host half: the physical cores it may run on
    (`os.sched_getaffinity(0)`, hyperthreads counted once), but no more than its share of the node's
    physical cores (one rank per GPU) unless `ranks_bound`, since ranks nothing bound apart all run on the
    same CPUs. SGLang sets 1 thread on GPU servers while loading weights (model_runner.py:1279,
    `torch.set_num_threads(1)`, never raised again), which would run every cold matmul on one core."""
    own = max(1, physical_cores(os.sched_getaffinity(0)))
    if ranks_bound:
        return own
    node = physical_cores(range(os.cpu_count() or 1))
    return max(1, min(own, node // max(1, torch.cuda.device_count())))


def sglang_binds_ranks() -> bool:
    """Whether SGLang bound each rank to physical cores of its own and their siblings
    (`SGLANG_SET_CPU_AFFINITY`: scheduler.py:6302-6303, `set_gpu_proc_affinity`, utils/common.py:
    3028-3056), so that the rank's allowed CPUs are all its own (a server only: imports SGLang)."""
    from sglang.srt.environ import envs

    return envs.SGLANG_SET_CPU_AFFINITY.get()


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` (None: as it is) for the block, then put back."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def mask_cold_(ids: torch.Tensor, weights: torch.Tensor, boundary: int, routed: int) -> None:
    """Mask the slots routed to offloaded rows [boundary, routed) in place: id -1, weight 0. Device ops,
    queued on the current stream; fused shared experts (rows >= routed) and -1 padding stay."""
    cold = (ids >= boundary) & (ids < routed)
    ids.masked_fill_(cold, -1)
    weights.masked_fill_(cold, 0)


class HostRoundTrip:
    """One model's host round trip, shared by its eligible layers (they run one after the other, and a
    layer's `add` always follows its own `send`). `threads`: torch's intra-op threads for the host half
    (None: the process's). `real_tokens()`: the step's real token count, rows past it being CUDA-graph
    padding, or None where every row is a token; read at each `send`, since a replayed break gets the
    capture's arguments."""

    def __init__(self, copies: Copies, stats: HostExpertStats, threads: int | None = None,
                 real_tokens: Callable[[], int | None] | None = None) -> None:
        self.copies, self.stats, self.threads, self.real_tokens = copies, stats, threads, real_tokens
        self.buffers: _Buffers | None = None
        self.host_s = 0.0  # the last layer's CPU time in `cold_output`
        self._pending: tuple[ExpertStore, int, int] | None = None  # (store, boundary, tokens)

    def send(self, store: ExpertStore, first_layer: bool, x: torch.Tensor, ids: torch.Tensor,
             weights: torch.Tensor) -> None:
        """Break 1: snapshot the real rows, mask the cold slots for the kernel, start the D2H copies."""
        self.copies.refuse_capture()
        self.stats.steps += first_layer
        self._pending = None
        real = self.real_tokens() if self.real_tokens is not None else None
        tokens = x.shape[0] if real is None else min(real, x.shape[0])
        if not store.offloaded_groups or not tokens:
            return
        buf = self._fit(tokens, x, ids, weights)
        snapshot = [(buf.device_x[:tokens], x[:tokens]), (buf.device_ids[:tokens], ids[:tokens]),
                    (buf.device_weights[:tokens], weights[:tokens])]
        for dst, src in snapshot:
            dst.copy_(src)
        boundary = store.boundary_expert  # live: offloads happen between steps, never inside one
        mask_cold_(ids, weights, boundary, store.routed_experts)
        self.copies.to_host([(buf.host_x[:tokens], buf.device_x[:tokens]),
                             (buf.host_ids[:tokens], buf.device_ids[:tokens]),
                             (buf.host_weights[:tokens], buf.device_weights[:tokens])])
        self._pending = (store, boundary, tokens)

    def add(self, out: torch.Tensor) -> None:
        """Break 2: wait for the D2H copies, compute the cold pairs on the CPU, copy them back, add."""
        if self._pending is None:
            return
        (store, boundary, tokens), buf = self._pending, self.buffers
        self._pending = None
        self.copies.wait_host()
        ids = buf.host_ids[:tokens]
        start = time.perf_counter()
        with intra_op_threads(self.threads):
            half, pairs = cold_output(buf.host_x[:tokens], ids, buf.host_weights[:tokens],
                                      (ids >= boundary) & (ids < store.routed_experts), store, buf.host_out[:tokens])
        self.host_s = time.perf_counter() - start
        self.stats.pairs += pairs
        if pairs:
            self.copies.to_device(buf.device_out[:tokens], half)
            out[:tokens].add_(buf.device_out[:tokens])

    def _fit(self, tokens: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> _Buffers:
        """The buffers for `tokens` rows, replaced by larger ones (the next power of two) once the side
        stream is idle, so no copy still reads or writes the old ones."""
        if self.buffers is not None and self.buffers.fits(tokens, x, ids, weights):
            return self.buffers
        self.copies.idle()
        rows = max(MIN_TOKENS, 1 << (tokens - 1).bit_length())
        shapes = [((rows, *x.shape[1:]), x.dtype), ((rows, *ids.shape[1:]), ids.dtype),
                  ((rows, *weights.shape[1:]), weights.dtype), ((rows, *x.shape[1:]), x.dtype)]
        self.buffers = _Buffers(rows, *(self.copies.device_buffer(s, d) for s, d in shapes),
                                *(self.copies.host_buffer(s, d) for s, d in shapes))
        return self.buffers


@functools.cache
def host_breaks() -> tuple[Callable[..., None], Callable[..., None]]:
    """`send` and `add` as `eager_on_graph` breaks: eager between a breakable graph's segments (capture and
    every replay, with the capture-time tensors, which each replay refills), plain calls elsewhere."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph

    @eager_on_graph
    def vamp_host_send(trip: HostRoundTrip, store: ExpertStore, first_layer: bool, x: torch.Tensor,
                       ids: torch.Tensor, weights: torch.Tensor) -> None:
        trip.send(store, first_layer, x, ids, weights)

    @eager_on_graph
    def vamp_host_add(trip: HostRoundTrip, out: torch.Tensor) -> None:
        trip.add(out)

    return vamp_host_send, vamp_host_add


def run_moe_core_host_cuda(original: Any, layer: Any, store: ExpertStore, trip: HostRoundTrip,
                           first_layer: bool, dispatch_output: Any) -> Any:
    """`run_moe_core` between the two breaks: the kernel reads the ids `send` masked in place."""
    send, add = host_breaks()
    topk = dispatch_output.topk_output
    send(trip, store, first_layer, dispatch_output.hidden_states, topk.topk_ids, topk.topk_weights)
    out = original(layer, dispatch_output=dispatch_output)
    add(trip, out.hidden_states)
    return out
