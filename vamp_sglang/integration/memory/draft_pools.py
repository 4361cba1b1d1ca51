"""The draft model's KV pools grow with the target's (speculative decoding: EAGLE, EAGLE3, NEXTN/MTP).

SGLang 0.5.23 builds each draft runner's KV pool (the primary one, and one per step for multi-layer EAGLE)
with the target's `memory_pool_config`, `req_to_token_pool` and allocator (managers/scheduler.py:1098-1111;
mem_cache/kv_cache_configurator.py:748): one token id names a row in the target pool and in every draft pool.
Growing the allocator alone would hand the draft ids past its pool's end. So each draft pool is laid over
growable buffers with the target's row count (`lay_draft_pool`), and a remap splits its pages over the
target's and the drafts' buffers together (`KVBufferSet`): every group offloaded adds the same rows to every
buffer, in one transaction, and one pool size is published for all of them. The tokens a group buys are then
its freed bytes over the target's and the draft's KV bytes per token (paper IV-C: c = freed / kv_bytes_per_token
with the draft layers counted), and a rollback or restore moves the draft rows back with the target's.

A draft whose KV row differs from the target's (other heads or head size) is refused when its pool is laid
out: equal rows keep "rows per buffer" one number for every buffer, which is what the page split relies on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vamp_sglang.integration.memory import kv_pool
from vamp_sglang.integration.memory.kv_pool import GrowablePool, UnsupportedPoolError
from vamp_sglang.memory.backend import PageBackend, PageHandle, VmmRuleError
from vamp_sglang.memory.journal import Journal, atomic
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers


class KVBufferSet:
    """The target's and the drafts' `GrowableKVBuffers` as one set of buffers for the `Repartitioner`: the
    same pages per buffer and rows per page in every member, so a remap's pages split evenly over all of
    them and every member serves the same rows."""

    def __init__(self, members: Sequence[GrowableKVBuffers]) -> None:
        if not members:
            raise ValueError("a KV buffer set needs at least the target's buffers")
        first = members[0]
        for m in members[1:]:
            shape = (m.row_bytes, m.row_multiple, m.pages_per_buffer, m.backend)
            if shape != (first.row_bytes, first.row_multiple, first.pages_per_buffer, first.backend):
                raise UnsupportedPoolError(
                    f"a draft KV pool of {m.row_bytes} B rows ({m.pages_per_buffer} pages per buffer) cannot "
                    f"grow with the target's {first.row_bytes} B rows ({first.pages_per_buffer} pages): VAMP "
                    "needs a draft whose KV row equals the target's; run with --vamp-max-offload-ratio 0")
        self.members = list(members)
        self.backend: PageBackend = first.backend

    @property
    def n_buffers(self) -> int:
        return sum(m.n_buffers for m in self.members)

    @property
    def pages_per_buffer(self) -> int:
        return self.members[0].pages_per_buffer

    @property
    def max_pages_per_buffer(self) -> int:
        return min(m.max_pages_per_buffer for m in self.members)

    @property
    def row_capacity(self) -> int:
        return self.members[0].row_capacity

    def rows_for_pages(self, pages_per_buffer: int) -> int:
        return self.members[0].rows_for_pages(pages_per_buffer)

    def grow(self, handles: Sequence[PageHandle], journal: Journal | None = None) -> int:
        """Map `handles` at every member's buffer tails, `n_buffers` even shares; returns the new rows."""
        per_buffer, rest = divmod(len(handles), self.n_buffers)
        if rest:
            raise VmmRuleError(f"grow: {len(handles)} pages do not split evenly over {self.n_buffers} buffers")
        with atomic(journal) as j:
            start = 0
            for m in self.members:
                end = start + per_buffer * m.n_buffers
                m.grow(handles[start:end], j)
                start = end
        return self.row_capacity

    def shrink(self, n_pages: int, tail_is_free: Callable[[int, int], bool],
               journal: Journal | None = None) -> list[PageHandle]:
        """Unmap `n_pages` from every member's buffer tails; `tail_is_free` confirms the dropped rows first."""
        if journal is None:
            self.backend.synchronize()
        with atomic(journal, on_failure=self.backend.synchronize) as j:
            return [h for m in self.members for h in m.shrink(n_pages, tail_is_free, j)]


def lay_draft_pool(pool: Any, target: GrowablePool) -> GrowablePool:
    """A draft runner's KV pool (MHA or MLA, as `kv_pool.check_pool` accepts) over growable buffers with the
    target's rows now and its reservation, in the target's page backend (replaces SGLang's buffer creation)."""
    kv_pool.check_pool(pool, draft=True)
    if int(pool.size) != int(target.pool.size) or int(pool.page_size) != target.page_size:
        raise UnsupportedPoolError(f"the draft KV pool ({pool.size} tokens, page size {pool.page_size}) does not "
                                   f"match the target's ({target.pool.size}, {target.page_size}): VAMP grows them "
                                   "together; run with --vamp-max-offload-ratio 0")
    heads, row, per_layer = (1, pool.kv_cache_dim, 1) if kv_pool.is_mla(pool) else (pool.head_num, pool.head_dim, 2)
    row_bytes = heads * row * pool.store_dtype.itemsize
    if row_bytes != target.kv.row_bytes:
        raise UnsupportedPoolError(f"the draft's KV row ({row_bytes} B per layer) differs from the target's "
                                   f"({target.kv.row_bytes} B): VAMP grows the two pools by one row count, which "
                                   "needs equal rows; run with --vamp-max-offload-ratio 0")
    kv = GrowableKVBuffers(target.kv.backend, int(pool.layer_num), heads, row, pool.store_dtype,
                           initial_rows=target.kv.row_capacity, max_rows=target.kv.max_row_capacity,
                           row_multiple=pool.page_size, buffers_per_layer=per_layer)
    for buffer in kv.buffers:
        buffer.zero_()
    return GrowablePool(pool, kv)


def check_laid(pool: Any, target: GrowablePool | None, drafts: Sequence[GrowablePool]) -> None:
    """A draft runner must be left with the target's pool or one `lay_draft_pool` laid (or, on a hybrid model,
    the HybridLinearKVPool around one, which then mirrors its size): a pool built past the
    hooked buffer creators (another `_create_buffers` path, or one made before the runner's
    `alloc_memory_pool`) keeps its start-up rows while the shared allocator hands out grown ids."""
    if pool is None or target is None or pool is target.pool or any(pool is d.pool for d in drafts):
        return
    inner = getattr(pool, "full_kv_pool", None)  # a hybrid draft (Qwen3-Next's MTP layer): the attention pool
    laid = next((d for d in drafts if inner is not None and inner is d.pool), None)
    if laid is not None:  # its HybridLinearKVPool wrapper keeps a copy of the size, as the target's does
        laid.size_mirrors.append(pool)
        return
    raise UnsupportedPoolError(f"the draft runner's KV pool ({type(pool).__name__}) was not built through the "
                               "buffer creators VAMP grows, so it would keep its start-up size while the "
                               "shared allocator grows; run with --vamp-max-offload-ratio 0")


def buffer_set(target: GrowablePool, drafts: Sequence[GrowablePool]) -> GrowableKVBuffers | KVBufferSet:
    """What the `Repartitioner` grows: the target's buffers alone, or with every draft pool's."""
    return KVBufferSet([target.kv, *(d.kv for d in drafts)]) if drafts else target.kv


def draft_stats(drafts: Sequence[GrowablePool]) -> list[dict[str, int]]:
    """`/vamp/stats` `draft_pools`: each draft pool's size (tokens), layers and mapped buffer rows."""
    return [{"tokens": int(d.pool.size), "layers": int(d.pool.layer_num), "buffer_rows": d.kv.row_capacity}
            for d in drafts]


class SpeculationStats:
    """`/vamp/stats` `speculation`: SGLang's algorithm and its mean accept length (tokens committed per verify,
    the lifetime totals of its metrics reporter plus the window not yet logged; None before the first verify),
    the figure that says how many tokens a decode step's staged expert bytes are spread over."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def stats(self) -> dict[str, Any]:
        reporter = self.scheduler.metrics_reporter
        tokens = reporter.spec_total_num_accept_tokens + reporter.spec_num_accept_tokens
        verifies = reporter.spec_total_num_forward_ct + reporter.spec_num_forward_ct
        return {"speculation": {"algorithm": self.scheduler.spec_algorithm.name, "verify_steps": int(verifies),
                                "accept_length": round(tokens / verifies, 4) if verifies else None}}
