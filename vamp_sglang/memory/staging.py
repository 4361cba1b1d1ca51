"""Double-buffered staging of offloaded experts (paper IV-D, V-B, Figure 5).

Two staging slots alternate by eligible-layer parity. As soon as MoE layer N may start (`before_moe(N)`
has waited for N's own copy), the offloaded region of the next eligible layer is copied from its host
copy into the other slot, so the copy overlaps layer N's MoE computation and the dense and router work
before the next MoE layer. The other slot's last reader, eligible layer N-1, has finished by then:
on the host the forward is synchronous; on CUDA the copy stream waits for the event `after_moe` recorded
when that layer's MoE was enqueued. Copies run on a copy stream (CUDA) or a single worker thread (host,
with one intra-op thread so it overlaps the compute thread instead of fighting it for cores;
research/host-vmm.md section 4). The whole contiguous offloaded region is staged whatever the router
selects (IV-D). The first eligible layer is prefetched at forward start (`begin_forward`).

The slots' pages are aliased into each expert tensor's offloaded range (experts.py), so the copy
destination is the expert tensor itself and the kernel reads fixed addresses. A CUDA graph captured
without these copies would replay stale slot contents: the glue must run eager while any expert is
offloaded.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from vamp_sglang.memory.backend import PageBackend, PageHandle
from vamp_sglang.memory.experts import ExpertStore
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.region import PagedRegion

STAGING_MODES = ("async", "sync")


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
        if layout.bound_groups:
            self.slots.append(StagingSlot(backend, layout))
            try:
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

    def close(self) -> None:
        for slot in self.slots:
            slot.close(self.backend)
        self.slots = []


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
            stores.append(ExpertStore(backend, layout, layer_id, w13, w2, *staging.alias_pages(layer_id)))
    except BaseException:
        for store in stores:
            store.close()
        staging.close()
        raise
    return staging, stores


@dataclass(frozen=True)
class StagingStats:
    wait_s: float  # host: time before_moe blocked on a copy; CUDA: not measured (0)
    bytes_staged: int
    copies: int
    stalls: int  # copies not finished when their layer's MoE was reached
    unprefetched: int  # copies issued at before_moe because nothing prefetched them


class StagingEngine:
    """Fills each eligible layer's offloaded experts one MoE layer ahead (paper V-B, Figure 5)."""

    def __init__(self, stores: Sequence[ExpertStore], mode: str = "async") -> None:
        if mode not in STAGING_MODES:
            raise ValueError(f"staging mode must be one of {', '.join(STAGING_MODES)} (got {mode!r})")
        self.mode = mode
        self._stores = list(stores)
        self._layer_ids = [s.layer_id for s in self._stores]
        if self._layer_ids != sorted(self._layer_ids):
            raise ValueError(f"stores must be in forward order (got layer ids {self._layer_ids})")
        self._index = {layer_id: i for i, layer_id in enumerate(self._layer_ids)}
        device = self._stores[0].w13.device if self._stores else torch.device("cpu")
        self._cuda = device.type == "cuda"
        self._pending: dict[int, Any] = {}  # eligible index -> Future (host) or torch.cuda.Event
        self._slot_free: list[Any] = [None, None]  # CUDA: event after the slot's last MoE kernel
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None
        if mode == "async" and self._cuda:
            self._stream = torch.cuda.Stream(device)
        elif mode == "async":
            self._executor = ThreadPoolExecutor(1, "vamp-staging", initializer=torch.set_num_threads,
                                                initargs=(1,))
        self._wait_s, self._bytes, self._copies, self._stalls, self._unprefetched = 0.0, 0, 0, 0, 0

    def begin_forward(self) -> None:
        """Prefetch the first eligible layer at forward start (the first MoE layer is resident)."""
        if self._stores and self.mode == "async":
            self._launch(0)

    def before_moe(self, layer_id: int) -> None:
        """Right before `layer_id`'s MoE kernel: block until its offloaded experts are staged, then start
        staging the next eligible layer into the other slot (paper V-B)."""
        i = self._index.get(layer_id)
        if i is not None and self._stores[i].offloaded_groups:
            if i not in self._pending:
                self._unprefetched += self.mode == "async"
                self._launch(i)
            self._wait(self._pending.pop(i))
        nxt = bisect.bisect_right(self._layer_ids, layer_id)
        if self.mode == "async" and nxt < len(self._stores):
            self._launch(nxt)

    def after_moe(self, layer_id: int) -> None:
        """Right after `layer_id`'s MoE kernel was issued: on CUDA, mark its slot free for the copy two
        eligible layers later (host: the kernel already finished)."""
        i = self._index.get(layer_id)
        if self._stream is not None and i is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._stream.device))
            self._slot_free[i % 2] = event

    def drain(self) -> None:
        """Finish and forget in-flight copies (before a remap changes the boundary)."""
        for handle in self._pending.values():
            self._wait(handle, count=False)
        self._pending.clear()

    def stats(self) -> StagingStats:
        return StagingStats(self._wait_s, self._bytes, self._copies, self._stalls, self._unprefetched)

    def close(self) -> None:
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _launch(self, i: int) -> None:
        store = self._stores[i]
        if i in self._pending or store.offloaded_groups == 0:
            return
        pairs = store.staging_pairs()
        self._bytes += store.staged_bytes()
        self._copies += 1
        if self._stream is not None:
            if self._slot_free[i % 2] is not None:  # the slot's last reader is done
                self._stream.wait_event(self._slot_free[i % 2])
            event = torch.cuda.Event()
            with torch.cuda.stream(self._stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                event.record(self._stream)
            self._pending[i] = event
        elif self._executor is not None:
            self._pending[i] = self._executor.submit(_copy_pairs, pairs)
        else:
            done: Future = Future()
            _copy_pairs(pairs)
            done.set_result(None)
            self._pending[i] = done

    def _wait(self, handle: Any, count: bool = True) -> None:
        if isinstance(handle, Future):
            if count and not handle.done():
                self._stalls += 1
            start = time.perf_counter()
            handle.result()
            if count:
                self._wait_s += time.perf_counter() - start
            return
        if count and not handle.query():
            self._stalls += 1
        torch.cuda.current_stream(self._stream.device).wait_event(handle)
        if not count:
            handle.synchronize()


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)
