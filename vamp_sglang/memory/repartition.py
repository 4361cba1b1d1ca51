"""Expert-to-KV repartitioning as transactions (paper IV-C, V-A).

`offload(n)` moves the residency boundary of every eligible layer down by n groups: the groups' pages
leave the expert tensors (whose offloaded range then reads the staging slot), join the tails of every
K and V buffer in equal shares, and the pool grows. `restore(n)` is the reverse and needs the dropped
KV rows to be free. Either call changes everything or nothing: every page move is recorded in one
journal and a failure anywhere (a map that fails half-way, the allocator refusing the new size) undoes
all of them, so no KV row in use and no expert byte is lost: the pages an offload lent to the pools
were zeroed or written there, so its rollback copies those experts back from the host copy.

Freed pages that do not split evenly over the K/V buffers are kept spare (at most n_buffers - 1 pages)
and used first by the next offload or restore; the pool size is therefore a function of the number of
offloaded groups alone, which is what lets TP ranks agree on it (`rows_gained`, paper V-A). Every
count here is in buffer rows; the pool size SGLang schedules from (tokens) is the caller's, handed
through each call to `on_pool_resize` unchanged.

On a hybrid model the linear-attention state pool can grow too (`state`, GrowableStateBuffers): an
offload names the pool its groups grow (`to_state`), and the state pool's size is a function of the
groups given to it (`state_groups`), so ranks that agree on the decisions agree on both sizes. A
restore returns the KV pool's groups first, then the state pool's (pages are interchangeable).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from vamp_sglang.memory.backend import PageHandle
from vamp_sglang.memory.experts import ExpertStore
from vamp_sglang.memory.journal import Journal, atomic
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers
from vamp_sglang.memory.layout import ExpertLayout, LayoutError, kv_pages_per_buffer
from vamp_sglang.memory.residency import Residency
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.state_buffers import GrowableStateBuffers


@dataclass(frozen=True)
class RepartitionStats:
    """The `/vamp/stats` `experts` and `kv_pool` figures."""

    eligible_layers: int
    groups_per_layer: int
    group_experts: int
    bound_groups: int
    offloaded_groups: int
    offload_ratio: float
    reclaimed_bytes: int  # expert bytes unmapped from the expert tensors
    spare_bytes: int  # reclaimed but not yet usable by KV (uneven split over buffers)
    rows: int  # rows each K/V buffer serves now
    initial_rows: int
    state_groups: int  # of the offloaded groups, those whose pages grew the state pool
    state_rows: int  # state slots per layer the state buffers hold now (padding slot included); 0: none
    remap_s: float  # wall time inside offload/restore transactions, after the quiescing synchronise
    remapped_bytes: int  # expert bytes those transactions moved

    @property
    def remap_gib_per_s(self) -> float:
        return self.remapped_bytes / self.remap_s / 2**30 if self.remap_s else 0.0


class Repartitioner:
    """Moves the residency boundary of all eligible layers together; one instance per TP rank."""

    def __init__(self, layout: ExpertLayout, expert_stores: Sequence[ExpertStore], kv_buffers: GrowableKVBuffers,
                 on_pool_resize: Callable[[int, int, int | None], None], *, tail_is_free: Callable[[int, int], bool],
                 staging: StagingEngine | None = None, state: GrowableStateBuffers | None = None,
                 on_state_resize: Callable[[int, int, bool], None] | None = None,
                 residency: Residency | None = None) -> None:
        """`on_pool_resize(old_rows, new_rows, pool_tokens)` publishes the new pool size (`pool_tokens`,
        as the caller passed it to offload/restore: allocator free list and every copy of the size);
        it is the last step of a transaction, and raising from it aborts the remap.
        `tail_is_free(first_row, end_row)` confirms rows a restore would drop hold no live tokens.
        `on_state_resize(old_rows, new_rows, rollback)` does the same for the state pool (hybrid models);
        it must refuse a shrink over slots in use. A restore publishes it before unmapping (so a slot in use
        refuses before any page moves); `rollback` True is the undo of that publish when a later step
        failed, which must not fail on purpose (no fault injection). `residency` (residency by routing)
        reorders expert rows inside each transaction so the offloaded rows hold the coldest experts."""
        layer_ids = tuple(s.layer_id for s in expert_stores)
        if layer_ids != layout.eligible_layer_ids:
            raise LayoutError(f"expert_stores cover layers {layer_ids}, expected the eligible layers "
                              f"{layout.eligible_layer_ids} in order")
        if len({s.offloaded_groups for s in expert_stores}) > 1:
            raise LayoutError("expert_stores must start with one residency boundary")
        self.layout = layout
        self.stores = list(expert_stores)
        self.kv = kv_buffers
        self.staging = staging
        self.residency = residency
        self._on_pool_resize = on_pool_resize
        self._tail_is_free = tail_is_free
        if (state is None) != (on_state_resize is None):
            raise ValueError("a state pool needs on_state_resize, and on_state_resize a state pool")
        self.state, self._on_state_resize = state, on_state_resize
        self._state_groups = 0
        self._state_base_rows = state.rows if state is not None else 0
        self._spare: list[PageHandle] = []
        self.remap_s, self.remapped_bytes = 0.0, 0
        self._undoing = False  # inside `undoing()`
        self._offloaded = self.stores[0].offloaded_groups if self.stores else 0
        self._base_pages = kv_buffers.pages_per_buffer - self._kv_extra_pages(self._offloaded)
        self.initial_rows = kv_buffers.rows_for_pages(self._base_pages)
        need = self._base_pages + self._kv_extra_pages(layout.bound_groups)
        if need > kv_buffers.max_pages_per_buffer:
            raise LayoutError(f"KV buffers reserve {kv_buffers.max_pages_per_buffer} pages each; the offload "
                              f"bound needs {need} (raise max_rows to {kv_buffers.rows_for_pages(need)})")

    @property
    def offloaded_groups(self) -> int:
        return self._offloaded

    @property
    def state_groups(self) -> int:
        """Offloaded groups whose pages grew the state pool (the rest grew the KV pool)."""
        return self._state_groups

    @property
    def kv_groups(self) -> int:
        return self._offloaded - self._state_groups

    def rows_at(self, kv_groups: int) -> int:
        """KV pool rows with `kv_groups` groups of every eligible layer given to the KV pool."""
        self.layout.check_offloaded_groups(kv_groups)
        return self.kv.rows_for_pages(self._base_pages + self._kv_extra_pages(kv_groups))

    def state_rows_at(self, state_groups: int) -> int:
        """State slots per layer (padding slot included) with `state_groups` groups given to the state pool."""
        if self.state is None:
            raise LayoutError("this model has no growable state pool")
        self.layout.check_offloaded_groups(state_groups)
        if state_groups == 0:  # the start size, though its pages may hold a few rows more
            return self._state_base_rows
        return self.state.rows_for_pages(self.state.pages_for(self._state_base_rows)
                                         + state_groups * self.layout.pages_freed_per_group)

    def rows_gained(self, n_groups: int) -> int:
        """Rows offloading `n_groups` more to the KV pool would add to each buffer (read-only)."""
        return self.rows_at(self.kv_groups + n_groups) - self.rows_at(self.kv_groups)

    def offload(self, n_groups: int, pool_tokens: int | None = None, to_state: bool = False) -> int:
        """Transaction: n groups of every eligible layer to the KV tails (or, `to_state`, to every
        state layer's tail); returns the rows (or state slots) added. `pool_tokens` is the KV pool size
        the caller publishes at the end (`on_pool_resize`; not called for a state offload)."""
        if to_state:
            self.state_rows_at(self._state_groups + n_groups)  # checks the pool and the bound first
        added = self._state_rows_gained(n_groups) if to_state else self.rows_gained(n_groups)
        if n_groups == 0:
            return 0
        start = self._quiesce()
        counts = self._agree_counts()  # before anything can fail
        old_rows, old, old_state = self.kv.row_capacity, self._offloaded, self._state_groups
        with atomic(None, on_failure=self.kv.backend.synchronize) as j:
            # rows swapped while resident; undone after the refill below
            boundary = self.layout.boundary_expert(old)
            self._reorder(j, boundary, self.layout.boundary_expert(old + n_groups), counts)
            # undone last: the pages are back under the experts by then, holding zeroed KV rows or slots
            j.record(lambda: self._refill_from_host(old + n_groups, old))
            freed = [h for store in self.stores for h in store.offload_tail_pages(n_groups, j)]
            pool = self._spare + freed
            if to_state:
                state_rows = self.state.rows
                new_state_rows = self.state_rows_at(old_state + n_groups)
                take = self.state.pages_for(new_state_rows) - self.state.pages_for(state_rows)
                self._set_state(old + n_groups, pool[take:], j, old_state + n_groups)
                self.state.grow_to(new_state_rows, pool[:take], j)
                self._on_state_resize(state_rows, new_state_rows, False)
            else:
                kv = old - old_state
                take = (self._kv_extra_pages(kv + n_groups) - self._kv_extra_pages(kv)) * self.kv.n_buffers
                self._set_state(old + n_groups, pool[take:], j, old_state)
                new_rows = self.kv.grow(pool[:take], j)
                self._on_pool_resize(old_rows, new_rows, pool_tokens)
        self._count_remap(start, n_groups)
        return added

    def restore(self, n_groups: int, pool_tokens: int | None = None, state_first: bool = False) -> int:
        """Transaction: n groups back into every eligible layer, from the KV tails first, then from
        the state tails (`state_first`: the other way round, to undo a state offload); returns KV rows
        removed. `pool_tokens` is the pool size the caller publishes at the end (`on_pool_resize`)."""
        from_state = min(n_groups, self._state_groups) if state_first else max(n_groups - self.kv_groups, 0)
        from_kv = n_groups - from_state
        removed = self.rows_at(self.kv_groups) - self.rows_at(self.kv_groups - from_kv)
        if n_groups == 0:
            return 0
        self.layout.check_offloaded_groups(self._state_groups - from_state)
        start = self._quiesce()
        counts = self._agree_counts()  # before anything can fail
        old_rows, old, old_state = self.kv.row_capacity, self._offloaded, self._state_groups
        per_store = n_groups * self.layout.pages_per_group_per_layer
        with atomic(None, on_failure=self.kv.backend.synchronize) as j:
            kv = old - old_state
            drop = self._kv_extra_pages(kv) - self._kv_extra_pages(kv - from_kv)
            pool = self._spare + self.kv.shrink(drop, self._tail_is_free, j)
            if from_state:
                state_rows, new_state_rows = self.state.rows, self.state_rows_at(old_state - from_state)
                self._on_state_resize(state_rows, new_state_rows, False)  # refuses slots in use, before any unmap
                j.record(lambda: self._on_state_resize(new_state_rows, state_rows, True))
                pool += self.state.shrink_to(new_state_rows, j)
            for k, store in enumerate(self.stores):
                store.restore_tail(pool[k * per_store:(k + 1) * per_store], n_groups, j)
            boundary = self.layout.boundary_expert(old - n_groups)  # the returned rows are resident again
            self._reorder(j, boundary, boundary, counts)
            self._set_state(old - n_groups, pool[len(self.stores) * per_store:], j, old_state - from_state)
            self._on_pool_resize(old_rows, self.kv.row_capacity, pool_tokens)
        self._count_remap(start, n_groups)
        return removed

    @contextmanager
    def undoing(self) -> Iterator[None]:
        """The transactions inside undo a round another rank refused (ExpertMemory.return_to). Only the
        ranks that applied the round run them, so residency by routing must not sum counts there (a
        collective the other ranks never enter): it replays the round's swaps inverted instead."""
        self._undoing = True
        try:
            yield
        finally:
            self._undoing = False

    def _agree_counts(self) -> torch.Tensor | None:
        """The ranks' summed routing counts (a collective, right after the quiescing synchronise and before
        any step that can fail on one rank alone); None without residency by routing or in an undo."""
        return self.residency.agree() if self.residency is not None and not self._undoing else None

    def _reorder(self, journal: Journal, resident_end: int, target_boundary: int,
                 counts: torch.Tensor | None) -> None:
        if self.residency is None:
            return
        if self._undoing:
            self.residency.revert_last(journal, resident_end)
        else:
            self.residency.reorder(journal, resident_end, target_boundary, counts)

    def stats(self) -> RepartitionStats:
        lay = self.layout
        gran = lay.granularity_bytes
        return RepartitionStats(
            eligible_layers=len(lay.eligible_layer_ids), groups_per_layer=lay.groups_per_layer,
            group_experts=lay.group_experts, bound_groups=lay.bound_groups, offloaded_groups=self._offloaded,
            offload_ratio=lay.offload_ratio(self._offloaded),
            reclaimed_bytes=self._offloaded * lay.bytes_freed_per_group, spare_bytes=len(self._spare) * gran,
            rows=self.kv.row_capacity, initial_rows=self.initial_rows, state_groups=self._state_groups,
            state_rows=self.state.rows if self.state is not None else 0,
            remap_s=self.remap_s, remapped_bytes=self.remapped_bytes)

    def _kv_extra_pages(self, offloaded_groups: int) -> int:
        return kv_pages_per_buffer(offloaded_groups, self.layout.pages_freed_per_group, self.kv.n_buffers)

    def _quiesce(self) -> float:
        """No copy or kernel may touch pages while they move: the one synchronise before a transaction
        (the steps inside do not synchronise again, issue 10 item 8). Returns the start time."""
        if self.staging is not None:
            self.staging.drain()
        self.kv.backend.synchronize()
        return time.perf_counter()

    def _count_remap(self, start: float, n_groups: int) -> None:
        """Remap throughput for `/vamp/stats`: bytes unmapped from the experts and mapped into the KV
        buffers (or back), over the transaction's wall time."""
        self.remap_s += time.perf_counter() - start
        self.remapped_bytes += n_groups * self.layout.bytes_freed_per_group

    def _refill_from_host(self, offloaded_groups: int, resident_from: int) -> None:
        """A rolled-back offload: the experts whose pages it lent out read their host copy again."""
        first, end = self.layout.boundary_expert(offloaded_groups), self.layout.boundary_expert(resident_from)
        for store in self.stores:
            store.copy_from_host(first, end)

    def _state_rows_gained(self, n_groups: int) -> int:
        return self.state_rows_at(self._state_groups + n_groups) - self.state_rows_at(self._state_groups)

    def _set_state(self, offloaded: int, spare: list[PageHandle], journal: Journal, state_groups: int) -> None:
        old = (self._offloaded, self._spare, self._state_groups)
        self._offloaded, self._spare, self._state_groups = offloaded, spare, state_groups
        journal.record(lambda: self._restore_state(*old))

    def _restore_state(self, offloaded: int, spare: list[PageHandle], state_groups: int) -> None:
        self._offloaded, self._spare, self._state_groups = offloaded, spare, state_groups

    def close(self) -> None:
        """Release the spare pages (the stores and KV buffers are closed by their owners)."""
        for handle in self._spare:
            self.kv.backend.release(handle)
        self._spare = []
