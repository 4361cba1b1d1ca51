"""The two staging slots of offloaded experts and their aliases in the expert stores (paper IV-D, V-B).

Two staging slots alternate by eligible-layer parity: eligible layer i reads slot i % 2, so the staging
engine (staging.py) can fill the next eligible layer's slot while the current layer's MoE reads the other.

The slots' pages are aliased into each expert tensor's offloaded range (experts.py), so the copy
destination is the expert tensor itself and the kernel reads fixed addresses: a CUDA graph can hold the
MoE kernels as long as the engine's hooks run eagerly between its segments (SGLang's breakable graphs,
see integration/staging/moe_staging.py). Every layer's host copy lives in one host arena held here next to the
slots; the stores that alias the slots and read the arena are closed before either is freed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from vamp_sglang.memory.backend import HostArena, PageBackend, PageHandle
from vamp_sglang.memory.experts import ExpertStore, host_copy_bytes
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.region import PagedRegion


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
