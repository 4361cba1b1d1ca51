"""Double-buffered staging of offloaded experts (paper IV-D, V-B, Figure 5).

Two staging slots alternate by eligible-layer parity. As soon as MoE layer N may start (`before_moe(N)`
has waited for N's own copy), the offloaded region of the next eligible layer is copied from its host
copy into the other slot, so the copy overlaps layer N's MoE computation and the dense and router work
before the next MoE layer. The other slot's last reader, eligible layer N-1, has finished by then:
on the host the forward is synchronous; on CUDA the copy stream waits for the slot's event, recorded
after that layer's MoE was enqueued (`after_moe`) or, when `after_moe` did not run (a graph replay), at
the launch itself on the compute stream, which orders it after every kernel enqueued so far. Copies run
on a copy stream (CUDA) or a single worker thread (host, with one intra-op thread so it overlaps the
compute thread instead of fighting it for cores; research/host-vmm.md section 4). The whole contiguous
offloaded region is staged whatever the router selects (IV-D). The first eligible layer is prefetched
at forward start (`begin_forward`).

The slots' pages are aliased into each expert tensor's offloaded range (experts.py), so the copy
destination is the expert tensor itself and the kernel reads fixed addresses: a CUDA graph can hold the
MoE kernels as long as these hooks run eagerly between its segments (SGLang's breakable graphs, see
integration/moe_staging.py). While a stream is capturing the hooks do nothing: an event recorded in a
capture is a graph node, and an eager wait on it is invalid (issue 10 item 1). The two slot events are
therefore recorded once at construction, outside any capture, as SGLang's DWDP weight manager does.

Copy and wait times are measured where the work happens (issue 10 item 5): on CUDA with timing events
read back once they completed (never by querying the copy when the CPU enqueues the wait), on the host
with the worker's and the waiting thread's clocks.

Routed-only staging (issue 12): a step may instead copy, at each eligible layer once its router ran, only
the offloaded experts some token selected (memory/routed.py), in the compute stream or thread, with no
prefetch. `begin_forward(tokens)` picks the step's mode (staging_choice.py: from the measured bandwidths,
the measured overlap window and the expected distinct experts for that many tokens); `before_moe(layer_id,
topk_ids)` then stages that way. Both modes write the same aliased rows, so they mix freely across steps.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from vamp_sglang.memory.backend import HostArena, PageBackend, PageHandle
from vamp_sglang.memory.experts import ExpertStore, host_copy_bytes
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.region import PagedRegion
from vamp_sglang.memory.routed import copy_routed_host, routed_offloaded_runs
from vamp_sglang.memory.staging_choice import ROUTED, WHOLE, StagingChooser

STAGING_MODES = ("async", "sync")
logger = logging.getLogger(__name__)


class StagingSlot:
    """One staging buffer: bound_groups groups of w13 pages and of w2 pages."""

    def __init__(self, backend: PageBackend, layout: ExpertLayout) -> None:
        gran = backend.granularity_bytes
        self._regions: list[PagedRegion] = []
        try:
            for group_pages in (layout.w13_group_pages, layout.w2_group_pages):
                region = PagedRegion(backend, layout.bound_groups * group_pages * gran)
                self._regions.append(region)
                region.append_new_pages(layout.bound_groups * group_pages)
        except BaseException:
            self.close(backend)
            raise

    @property
    def w13_pages(self) -> tuple[PageHandle, ...]:
        return self._regions[0].handles

    @property
    def w2_pages(self) -> tuple[PageHandle, ...]:
        return self._regions[1].handles

    @property
    def nbytes(self) -> int:
        return sum(r.mapped_bytes for r in self._regions)

    def close(self, backend: PageBackend) -> None:
        """Release the slot's pages; aliases still mapped in expert tensors keep them alive until unmapped."""
        for region in self._regions:
            for handle in region.close():
                backend.release(handle)
        self._regions = []


class StagingBuffers:
    """The two slots; eligible layer i reads slot i % 2. No slots when nothing may be offloaded."""

    def __init__(self, backend: PageBackend, layout: ExpertLayout) -> None:
        self.backend = backend
        self.layout = layout
        self.slots: list[StagingSlot] = []
        self.host_arena: HostArena | None = backend.host_arena(host_copy_bytes(layout))  # every layer's host copy
        try:
            for _ in range(2 if layout.bound_groups else 0):
                self.slots.append(StagingSlot(backend, layout))
        except BaseException:
            self.close()
            raise

    def alias_pages(self, layer_id: int) -> tuple[tuple[PageHandle, ...], tuple[PageHandle, ...]]:
        """(w13 pages, w2 pages) that back `layer_id`'s offloaded range."""
        if not self.slots:
            return (), ()
        slot = self.slots[self.layout.eligible_index(layer_id) % 2]
        return slot.w13_pages, slot.w2_pages

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes behind the host copies (0 on the host backend)."""
        return self.host_arena.pinned_bytes if self.host_arena is not None else 0

    def close(self) -> None:
        """Free the slots and the host arena; the stores that use them must be closed first."""
        for slot in self.slots:
            slot.close(self.backend)
        self.slots = []
        if self.host_arena is not None:
            self.host_arena.close()
            self.host_arena = None


def build_expert_stores(backend: PageBackend, layout: ExpertLayout,
                        weights: Mapping[int, tuple[torch.Tensor, torch.Tensor]]
                        ) -> tuple[StagingBuffers, list[ExpertStore]]:
    """Staging slots plus one ExpertStore per eligible layer (`weights[layer_id] = (w13, w2)`),
    in forward order; everything built so far is freed if one fails."""
    staging = StagingBuffers(backend, layout)
    stores: list[ExpertStore] = []
    try:
        for layer_id in layout.eligible_layer_ids:
            w13, w2 = weights[layer_id]
            stores.append(ExpertStore(backend, layout, layer_id, w13, w2, *staging.alias_pages(layer_id),
                                      host_arena=staging.host_arena))
    except BaseException:
        close_expert_stores(staging, stores)
        raise
    return staging, stores


def close_expert_stores(staging: StagingBuffers, stores: Sequence[ExpertStore]) -> None:
    """Close the stores, then the staging slots and host arena they read (in that order)."""
    for store in stores:
        store.close()
    staging.close()


@dataclass(frozen=True)
class StagingStats:
    """Cumulative staging figures, and the last completed step's (a step = one forward)."""

    wait_s: float  # time the compute side stood waiting for a copy (CUDA: device clock, host: thread clock)
    copy_s: float  # time the copies took (CUDA: copy-stream events, host: the worker's clock)
    bytes_staged: int
    copies: int
    stalls: int  # copies not finished when their layer's MoE was reached (measured, not guessed)
    unprefetched: int  # copies issued at before_moe because nothing prefetched them
    steps: int  # forwards begun (begin_forward calls outside capture)
    timed_copies: int  # copies whose times were read back so far (CUDA reads them once they completed)
    step_copy_s: float  # copy_s of the last step whose copies were all read back
    step_wait_s: float  # wait_s of that step
    by_mode: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # whole / routed: steps, bytes,
    # copy_s, wait_s (issue 12)


@dataclass(eq=False)
class _Copy:
    """One layer's staging copy: w13 first, then w2, each with its own completion (paper V-B: the gate-up
    GEMM needs only w13). Host: futures; CUDA: events on the copy stream."""

    step: int
    w13_done: Any
    w2_done: Any
    start: Any = None  # CUDA: timing event before the first copy
    reached: Any = None  # CUDA: timing event on the compute stream where the layer waited
    copy_s: float = 0.0  # host: measured by the worker
    wait_s: float = 0.0  # host: measured by the waiting thread
    stalled: bool = False
    split: bool = False  # its layer waited for w13 only at before_moe (w2 before the down GEMM)
    mode: str = WHOLE  # whole-region prefetch or routed-only copy (issue 12)
    tokens: int | None = None  # the step's token count, for the staging choice
    nbytes: int = 0  # whole: bytes staged; routed: filled in once the row count is read
    rows: Any = None  # routed: distinct offloaded rows copied (host int; CUDA: pinned int32[1] read later)
    row_bytes: int = 0  # routed: w13 + w2 bytes of one expert


class StagingEngine:
    """Fills each eligible layer's offloaded experts one MoE layer ahead (paper V-B, Figure 5)."""

    def __init__(self, stores: Sequence[ExpertStore], mode: str = "async",
                 is_capturing: Callable[[], bool] | None = None, split_w2_wait: bool = False,
                 staging: str = WHOLE, top_k: int | None = None,
                 routed_copier: Callable[[ExpertStore, torch.Tensor], torch.Tensor] | None = None) -> None:
        """`is_capturing()` says whether the current stream is capturing a CUDA graph (default: torch's
        check on CUDA, never on the host). `split_w2_wait`: `before_moe` waits only for w13 and the
        caller calls `before_down_proj` before the down projection reads w2 (paper V-B). `staging`: auto,
        whole or routed (issue 12); `top_k` is the router's, `routed_copier(store, topk_ids)` enqueues a
        routed copy on the current CUDA stream and returns its device row count (the host copies itself)."""
        if mode not in STAGING_MODES:
            raise ValueError(f"staging mode must be one of {', '.join(STAGING_MODES)} (got {mode!r})")
        self.mode = mode
        self.split_w2_wait = split_w2_wait
        self._stores = list(stores)
        self._layer_ids = [s.layer_id for s in self._stores]
        if self._layer_ids != sorted(self._layer_ids):
            raise ValueError(f"stores must be in forward order (got layer ids {self._layer_ids})")
        self._index = {layer_id: i for i, layer_id in enumerate(self._layer_ids)}
        device = self._stores[0].w13.device if self._stores else torch.device("cpu")
        self._cuda = device.type == "cuda"
        if is_capturing is None:
            is_capturing = torch.cuda.is_current_stream_capturing if self._cuda else _never
        self._is_capturing = is_capturing
        if self._cuda and staging != WHOLE and routed_copier is None:
            raise ValueError(f"staging {staging!r} on CUDA needs a routed_copier")
        self._routed_copier = routed_copier
        experts = self._stores[0].routed_experts if self._stores else 0
        self.chooser = StagingChooser(staging, top_k, experts, measure_steps=not self._cuda)
        self._step_mode, self._step_tokens, self._step_start = WHOLE, None, 0.0
        self._by_mode = {m: {"steps": 0, "bytes": 0, "copy_s": 0.0, "wait_s": 0.0} for m in (WHOLE, ROUTED)}
        self._pending: dict[int, _Copy] = {}  # eligible index -> copy in flight
        self._w2_pending: dict[int, _Copy] = {}  # split waits: w13 waited, w2 not yet
        self.missed_w2_waits = 0  # layers whose down GEMM ran without before_down_proj (split then off)
        self._timing: deque[_Copy] = deque()  # waited copies whose times are not read yet
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None
        self._slot_free: list[Any] = []
        self._reader_open = [False, False]  # the slot's reader waited but its after_moe did not run
        if mode == "async" and self._cuda:
            self._stream = torch.cuda.Stream(device)
            self._slot_free = [torch.cuda.Event(), torch.cuda.Event()]
            for event in self._slot_free:  # once, outside any capture: every later wait is on an eager record
                event.record(torch.cuda.current_stream(device))
        elif mode == "async":
            self._executor = ThreadPoolExecutor(1, "vamp-staging", initializer=torch.set_num_threads,
                                                initargs=(1,))
        self._step = 0
        self._bytes, self._copies, self._unprefetched = 0, 0, 0
        self._wait_s, self._copy_s, self._stalls, self._timed = 0.0, 0.0, 0, 0
        self._step_open = (-1, 0.0, 0.0)  # (step, copy_s, wait_s) being summed while its copies are read
        self._step_done = (0.0, 0.0)

    def begin_forward(self, tokens: int | None = None) -> None:
        """Pick this step's staging mode for `tokens` tokens (issue 12); whole: prefetch the first
        eligible layer at forward start (the first MoE layer is resident)."""
        if self._is_capturing():
            return
        self._step += 1
        self._harvest()
        self._step_tokens, self._step_start = tokens, time.perf_counter()
        store = self._stores[0] if self._stores else None
        self._step_mode = WHOLE if store is None or not store.offloaded_groups else self.chooser.choose(
            self._step, tokens, store.staged_bytes(), store.routed_experts - store.boundary_expert,
            _row_bytes(store))
        self._by_mode[self._step_mode]["steps"] += 1
        if self._stores and self.mode == "async" and self._step_mode == WHOLE:
            self._launch(0)

    def before_moe(self, layer_id: int, topk_ids: torch.Tensor | None = None) -> None:
        """Right before `layer_id`'s MoE kernel: block until its offloaded experts are staged, then start
        staging the next eligible layer into the other slot (paper V-B). In a routed step, copy only the
        offloaded experts `topk_ids` (the router's, [tokens, k]) selected, and prefetch nothing."""
        if self._is_capturing():
            return
        i = self._index.get(layer_id)
        routed = self._step_mode == ROUTED and topk_ids is not None
        if i is not None and self._stores[i].offloaded_groups and routed and i not in self._pending:
            self._stage_routed(i, topk_ids)
            self._reader_open[i % 2] = True  # a later prefetch into this slot must follow this layer's MoE
        elif i is not None and self._stores[i].offloaded_groups:
            if i not in self._pending:
                self._unprefetched += self.mode == "async"
                self._launch(i)
            copy = self._pending.pop(i)
            copy.split = self.split_w2_wait
            self._wait(copy, copy.w13_done if copy.split else copy.w2_done)
            if copy.split:
                self._w2_pending[i] = copy
            self._reader_open[i % 2] = True
        nxt = bisect.bisect_right(self._layer_ids, layer_id)
        if self.mode == "async" and self._step_mode == WHOLE and nxt < len(self._stores):
            self._launch(nxt)

    def before_down_proj(self, layer_id: int) -> None:
        """With `split_w2_wait`: right before the down projection, wait for the layer's w2 copy."""
        copy = None if self._is_capturing() else self._w2_pending.pop(self._index.get(layer_id, -1), None)
        if copy is not None:
            self._wait(copy, copy.w2_done, timed=False)

    def after_moe(self, layer_id: int) -> None:
        """Right after `layer_id`'s MoE kernel was issued: on CUDA, mark its slot free for the copy two
        eligible layers later (host: the kernel already finished)."""
        i = self._index.get(layer_id)
        if i is None or self._is_capturing():
            return
        if i in self._w2_pending:  # split waits, but nothing waited for w2 before the down GEMM read it
            self.missed_w2_waits += 1
            self.split_w2_wait = False  # wait for both at before_moe from the next layer on
            logger.warning("vamp: layer %d's down GEMM ran without waiting for its staged w2; split "
                           "w13/w2 waits are off from now on", layer_id)
            self.before_down_proj(layer_id)  # and order w2 before the slot is refilled
        if self._stream is not None:
            self._slot_free[i % 2].record(torch.cuda.current_stream(self._stream.device))
        self._reader_open[i % 2] = False
        if i == len(self._stores) - 1 and self._stores[i].offloaded_groups:  # the part staging touches
            self.chooser.observe_step(self._step, self._step_tokens, self._step_mode,
                                      time.perf_counter() - self._step_start)

    def drain(self) -> None:
        """Finish and forget in-flight copies (before a remap changes the boundary)."""
        for copy in [*self._pending.values(), *self._w2_pending.values()]:
            _finish(copy.w2_done)
        self._pending.clear()
        self._w2_pending.clear()

    def stats(self) -> StagingStats:
        self._harvest()
        return StagingStats(self._wait_s, self._copy_s, self._bytes, self._copies, self._stalls,
                            self._unprefetched, self._step, self._timed, *self._step_done,
                            by_mode={m: dict(v) for m, v in self._by_mode.items()})

    def close(self) -> None:
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _launch(self, i: int) -> None:
        store = self._stores[i]
        if i in self._pending or store.offloaded_groups == 0:
            return
        pairs = store.staging_pairs()  # [(w13 rows, host), (w2 rows, host)]
        nbytes = store.staged_bytes()
        self._bytes += nbytes
        self._by_mode[WHOLE]["bytes"] += nbytes  # counted when issued, as bytes_staged
        self._copies += 1
        if self._stream is not None:
            copy = self._launch_cuda(i % 2, pairs)
        else:
            copy = _Copy(self._step, Future(), Future())
            if self._executor is not None:
                self._executor.submit(self._copy_host, copy, pairs)
            else:
                self._copy_host(copy, pairs)
        copy.nbytes, copy.tokens = nbytes, self._step_tokens
        self._pending[i] = copy

    def _stage_routed(self, i: int, topk_ids: torch.Tensor) -> None:
        """Copy the routed offloaded experts of eligible layer `i` now, in the compute stream or thread:
        the MoE kernel that follows reads them (issue 12). The copy is all wait (not overlapped)."""
        store = self._stores[i]
        self._copies += 1
        copy = _Copy(self._step, None, None, mode=ROUTED, tokens=self._step_tokens, row_bytes=_row_bytes(store))
        if self._stream is not None:  # CUDA: device-side copy list and gather, timed by compute-stream events
            compute = torch.cuda.current_stream(self._stream.device)
            copy.start, copy.w2_done = _timing_event(), _timing_event()
            copy.start.record(compute)
            count = self._routed_copier(store, topk_ids)
            copy.rows = torch.empty(1, dtype=torch.int32, pin_memory=True)
            copy.rows.copy_(count, non_blocking=True)  # read at harvest, once the event completed
            copy.w2_done.record(compute)
            copy.w13_done, copy.reached = copy.w2_done, copy.start
        else:
            start = time.perf_counter()
            runs = routed_offloaded_runs(topk_ids, store.boundary_expert, store.routed_experts)
            copy_routed_host(store, runs)
            copy.copy_s = copy.wait_s = time.perf_counter() - start
            copy.rows = sum(end - first for first, end in runs)
            copy.w13_done = copy.w2_done = Future()
            copy.w2_done.set_result(None)
        self._timing.append(copy)

    def _launch_cuda(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _Copy:
        compute = torch.cuda.current_stream(self._stream.device)
        if self._reader_open[slot]:  # its after_moe did not run (graph replay): everything enqueued so far
            self._slot_free[slot].record(compute)  # on the compute stream includes that reader's MoE kernel
            self._reader_open[slot] = False
        copy = _Copy(self._step, _timing_event(), _timing_event(), start=_timing_event())
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._slot_free[slot])
            copy.start.record(self._stream)
            for (dst, src), done in zip(pairs, (copy.w13_done, copy.w2_done), strict=True):
                dst.copy_(src, non_blocking=True)
                done.record(self._stream)
        return copy

    def _copy_host(self, copy: _Copy, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Worker side: w13, then w2, each completing its own future; the worker's clock times both."""
        start = time.perf_counter()
        futures = (copy.w13_done, copy.w2_done)
        try:
            for (dst, src), done in zip(pairs, futures, strict=True):
                dst.copy_(src)
                copy.copy_s = time.perf_counter() - start
                done.set_result(None)
        except BaseException as exc:  # every waiter sees the failure instead of blocking forever
            for done in futures:
                if not done.done():
                    done.set_exception(exc)
            raise

    def _wait(self, copy: _Copy, done: Any, timed: bool = True) -> None:
        """Make the compute side wait for `done`; the first wait of a copy is the one that is timed."""
        if isinstance(done, Future):
            stalled = not done.done()
            start = time.perf_counter()
            done.result()
            if timed:
                copy.wait_s, copy.stalled = (time.perf_counter() - start) * stalled, stalled
                self._timing.append(copy)
            return
        compute = torch.cuda.current_stream(self._stream.device)
        if timed:
            copy.reached = _timing_event()
            copy.reached.record(compute)
            self._timing.append(copy)
        compute.wait_event(done)

    def _harvest(self) -> None:
        """Read back the times of waited copies that completed, in order, without blocking."""
        while self._timing and _completed(self._timing[0]):
            copy = self._timing.popleft()
            if copy.reached is not None:  # CUDA: device clocks
                copy.copy_s = copy.start.elapsed_time(copy.w2_done) / 1e3
                copy.wait_s = max(0.0, copy.reached.elapsed_time(copy.w13_done if copy.split
                                                                 else copy.w2_done)) / 1e3
                copy.stalled = copy.wait_s > 0
            self._copy_s += copy.copy_s
            self._wait_s += copy.wait_s
            self._account(copy)
            self._stalls += copy.stalled
            self._timed += 1
            step, step_copy, step_wait = self._step_open
            if copy.step != step:
                if step >= 0:
                    self._step_done = (step_copy, step_wait)
                step, step_copy, step_wait = copy.step, 0.0, 0.0
            self._step_open = (step, step_copy + copy.copy_s, step_wait + copy.wait_s)
        step, step_copy, step_wait = self._step_open
        if step >= 0 and not self._timing and step < self._step:  # that step's copies are all read
            self._step_done = (step_copy, step_wait)

    def _account(self, copy: _Copy) -> None:
        """Per-mode totals, and the staging choice's measurements, of one copy whose times were read."""
        store = self._stores[0]
        offloaded_rows = store.routed_experts - store.boundary_expert
        if copy.mode == ROUTED:
            rows = int(copy.rows.item()) if isinstance(copy.rows, torch.Tensor) else copy.rows
            copy.nbytes = rows * copy.row_bytes
            self._bytes += copy.nbytes
            self._by_mode[ROUTED]["bytes"] += copy.nbytes
            self.chooser.observe_routed(copy.tokens, copy.nbytes, copy.copy_s,
                                        None if isinstance(copy.rows, torch.Tensor) else rows, offloaded_rows)
        else:
            self.chooser.observe_whole(copy.step, copy.tokens, copy.nbytes, copy.copy_s, copy.wait_s)
        totals = self._by_mode[copy.mode]
        totals["copy_s"] += copy.copy_s
        totals["wait_s"] += copy.wait_s


def _row_bytes(store: ExpertStore) -> int:
    """w13 + w2 bytes of one expert (the layout's shard sizes)."""
    return store.layout.w13_shard_bytes + store.layout.w2_shard_bytes


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _completed(copy: _Copy) -> bool:
    if copy.reached is None:
        return copy.w2_done.done()
    return copy.w2_done.query() and copy.reached.query()


def _finish(done: Any) -> None:
    if isinstance(done, Future):
        done.result()
    else:
        done.synchronize()


def _never() -> bool:
    return False
