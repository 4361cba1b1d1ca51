"""SGLang's KV pool laid over growable buffers, and every copy of the pool size SGLang keeps.

Paper IV-C / V-A: the KV pool must grow in place when expert pages join it. SGLang builds one
`MHATokenToKVPool` whose per-layer K and V tensors are fixed-size allocations, an allocator whose free
list holds ids `1..size`, and a dozen by-value copies of the size taken at start-up. This module

- lays each layer's K and V tensor (an MLA pool's one latent tensor, `MLATokenToKVPool.kv_buffer[l]`,
  `[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`, mem_cache/memory_pool.py:4856) over the memory
  layer's `GrowableKVBuffers` (a reservation sized for the largest pool the offload bound allows), so
  growth maps pages at the tail at fixed addresses (the MLA pool's `data_ptrs` table stays valid);
- grows or shrinks the allocator's id space (shrinking only over free tail ids);
- republishes the size everywhere SGLang copied it (`publish_pool_size`, listed in `SIZE_COPIES`).

A hybrid model's `HybridLinearKVPool` wraps one such pool for its full-attention layers and keeps its
own copy of the size; the allocator serves the wrapper, which then mirrors every resize.

Token id t lives in buffer row t (row 0 is SGLang's padding slot), so the pool of size N uses rows
[0, N + page_size). The buffers hold whole pages, so at start they have a few spare rows past that;
those stay unused, and every row gained later is handed to SGLang one for one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers, KVShrinkError
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.refusals import attention as attention_refusals

# Every by-value copy of the pool size, refreshed by `publish_pool_size` (owner: attribute).
SIZE_COPIES = (
    "allocator.size", "allocator.num_pages (paged)", "token_to_kv_pool.size",
    "HybridLinearKVPool.size (hybrid models: the wrapper of the full-attention pool)",
    "model_runner.max_total_num_tokens", "model_runner.memory_pool_config.max_total_num_tokens",
    "scheduler.max_total_num_tokens", "scheduler.pool_stats_observer.max_total_num_tokens",
    "scheduler.invariant_checker.max_total_num_tokens", "scheduler.load_inquirer.max_total_num_tokens",
    "scheduler.kv_events_publisher.max_total_num_tokens", "scheduler.max_req_len",
    "scheduler.max_req_input_len",
)


class UnsupportedPoolError(RuntimeError):
    """SGLang built a KV pool or allocator VAMP cannot grow; the message says which and why."""


def is_mla(pool: Any) -> bool:
    """Whether `pool` is SGLang's plain MLA latent pool (one buffer per layer). Imports nothing: no SGLang
    pool exists before SGLang's memory_pool module is loaded, and eval/gpu_check.py, which builds pools
    of its own, must run without SGLang."""
    memory_pool = sys.modules.get("sglang.srt.mem_cache.memory_pool")
    return memory_pool is not None and type(pool) is memory_pool.MLATokenToKVPool


def resolved_attention_backends() -> dict[str, str | None]:
    """{flag: backend} as SGLang resolved them (its model overrides publish to the exec namespace, never to
    server_args); empty outside a server, where nothing was published."""
    from sglang.srt.runtime_context import get_exec

    try:
        kernel = get_exec().kernel
    except ValueError:  # "config namespace 'exec' not published": a pool built outside a server
        return {}
    return {flag: getattr(kernel, flag.removeprefix("--").replace("-", "_"))
            for flag in attention_refusals.BACKEND_FLAGS}


def check_pool(pool: Any, draft: bool = False) -> None:
    """Only the plain token-major MHA pool and the plain MLA latent pool are laid over growable buffers.
    MLA subclasses are refused by name: DSA's indexer cache (DSATokenToKVPool), FP4's scale buffers
    (MLATokenToKVPoolFP4), the unified and page-interleaved layouts. A `draft` pool (an MTP layer) starts at
    the draft's own layer id, not 0: pipeline parallelism is refused by the launcher, not read from it."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if is_mla(pool):
        backend_refusal = attention_refusals.tma_backend_refusal(resolved_attention_backends())
        problems = [
            (backend_refusal is not None, backend_refusal),
            (pool.use_dsa or pool.kv_scale_buffer is not None, "DSA indexer or KV scale buffers"),
            (pool.custom_mem_pool is not None, "a custom memory pool (PD disaggregation over NVLink)"),
            (pool.start_layer != 0 and not draft, f"layers from {pool.start_layer} (pipeline parallelism)"),
        ]
    elif type(pool) is not MHATokenToKVPool:
        problems = [(True, f"pool class {type(pool).__name__} (needs MHATokenToKVPool or MLATokenToKVPool)")]
    else:
        problems = [
            (pool.kv_cache_layout != "nhd", f"kv_cache_layout {pool.kv_cache_layout!r} (needs 'nhd')"),
            (pool.head_dim != pool.v_head_dim, f"v_head_dim {pool.v_head_dim} != head_dim {pool.head_dim}"),
            (pool.enable_custom_mem_pool, "a custom memory pool (PD disaggregation over NVLink)"),
        ]
    for bad, what in problems:
        if bad:
            raise UnsupportedPoolError(f"VAMP cannot grow this KV pool: {what}; run with "
                                       f"--vamp-max-offload-ratio 0")


def sglang_buffers(pool: Any) -> list[torch.Tensor]:
    """The pool's per-layer tensors as SGLang holds them: K then V (MHA), or the latent buffers (MLA)."""
    return [*pool.kv_buffer] if is_mla(pool) else [*pool.k_buffer, *pool.v_buffer]


class GrowablePool:
    """An `MHATokenToKVPool` whose k_buffer[l] / v_buffer[l] (an `MLATokenToKVPool` whose kv_buffer[l]) are
    views of `GrowableKVBuffers` rows."""

    def __init__(self, pool: Any, kv: GrowableKVBuffers) -> None:
        self.pool = pool
        self.kv = kv
        self.page_size = int(pool.page_size)
        self.baseline_tokens = int(pool.size)
        self.baseline_rows = kv.row_capacity  # rows mapped at start (>= baseline_tokens + page_size)
        self.size_mirrors: list[Any] = []  # wrappers keeping a copy of the size (HybridLinearKVPool)
        if is_mla(pool):
            pool.kv_buffer = [self._alias(t) for t in kv.buffers]
        else:
            pool.k_buffer = [self._alias(t) for t in kv.k_buffers]
            pool.v_buffer = [self._alias(t) for t in kv.v_buffers]

    def _growable(self) -> list[torch.Tensor]:
        """Our buffers in the order of `sglang_buffers(self.pool)`."""
        kv = self.kv
        return kv.buffers if kv.buffers_per_layer == 1 else [*kv.k_buffers, *kv.v_buffers]

    def size_for_rows(self, rows: int) -> int:
        """The largest SGLang pool size `rows` mapped buffer rows can serve."""
        return self.baseline_tokens + rows - self.baseline_rows

    def resize(self, new_tokens: int, zero_new_rows: bool = True) -> None:
        """Re-point SGLang's K/V tensors at `new_tokens + page_size` rows, in place. New rows are zeroed
        like SGLang's own buffers (they held expert bytes a moment ago); a rollback passes False
        because it may restore a size whose tail rows are not mapped again yet."""
        old_rows, new_rows = self.pool.size + self.page_size, new_tokens + self.page_size
        if new_rows > self.kv.max_row_capacity:
            raise KVShrinkError(f"pool size {new_tokens} needs {new_rows} rows, the buffers reserve "
                                f"{self.kv.max_row_capacity}")
        for sglang_view, buffer in zip(sglang_buffers(self.pool), self._growable(), strict=True):
            sglang_view.set_(buffer.untyped_storage(), 0, (new_rows, *buffer.shape[1:]))
            if zero_new_rows and new_rows > old_rows:
                sglang_view[old_rows:new_rows].zero_()
        self.pool.size = new_tokens
        for wrapper in self.size_mirrors:
            wrapper.size = new_tokens

    def _alias(self, buffer: torch.Tensor) -> torch.Tensor:
        """A tensor over `buffer`'s storage with exactly the rows SGLang expects (size + page_size)."""
        rows = self.baseline_tokens + self.page_size
        return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
            buffer.untyped_storage(), 0, (rows, *buffer.shape[1:]))


def lay_pool_over_growable(pool: Any, backend: PageBackend, layout: ExpertLayout) -> GrowablePool:
    """Build the pool's buffers over reservations large enough for the offload bound (replaces
    `MHATokenToKVPool._create_buffers_normal` or `MLATokenToKVPool._create_buffers`); the backend is the one
    the expert pages live in."""
    check_pool(pool)
    heads, row, per_layer = (1, pool.kv_cache_dim, 1) if is_mla(pool) else (pool.head_num, pool.head_dim, 2)
    kv = GrowableKVBuffers.for_layout(backend, layout, int(pool.layer_num), heads, row, pool.store_dtype,
                                      initial_rows=pool.size + pool.page_size, row_multiple=pool.page_size,
                                      buffers_per_layer=per_layer)
    for buffer in kv.buffers:
        buffer.zero_()
    return GrowablePool(pool, kv)


# ---- the allocator's id space ---------------------------------------------------------------------

def check_allocator(allocator: Any, pool: GrowablePool) -> None:
    """The allocator must serve the pool VAMP laid out, or the hybrid wrapper around it (which is
    then bound to mirror the pool's size)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if type(allocator) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        raise UnsupportedPoolError(f"VAMP cannot grow allocator {type(allocator).__name__}")
    if allocator.need_sort:
        raise UnsupportedPoolError("VAMP cannot grow a sorted (PD-disaggregation) allocator")
    kvcache = allocator.get_kvcache()
    wrapped = kvcache is not pool.pool and getattr(kvcache, "full_kv_pool", None) is pool.pool
    if (kvcache is not pool.pool and not wrapped) or allocator.size != pool.pool.size:
        raise UnsupportedPoolError("the scheduler's allocator does not serve the pool VAMP laid out")
    if wrapped and kvcache not in pool.size_mirrors:
        pool.size_mirrors.append(kvcache)


def _units(allocator: Any, tokens: int) -> int:
    """Free-list ids (tokens, or pages of page_size tokens) covering `tokens` tokens."""
    return tokens // allocator.page_size


def free_tail_start(allocator: Any) -> int:
    """Smallest size s such that every id above s is free (the pool could shrink to s now)."""
    return free_ids_tail_start(allocator.get_all_free_pages(), _units(allocator, allocator.size)) * allocator.page_size


def free_ids_tail_start(free_ids: torch.Tensor, top: int) -> int:
    """Smallest n such that every id in (n, top] is in `free_ids` (ids 1..top, each free at most once);
    the KV allocator's pages and the state pool's slots alike."""
    free = torch.sort(free_ids.cpu(), descending=True).values
    mismatch = (free != top - torch.arange(len(free))).nonzero()
    run = int(mismatch[0]) if len(mismatch) else len(free)  # ids top, top-1, ... all free
    return top - run


def grow_allocator(allocator: Any, new_tokens: int) -> None:
    """Append the ids of tokens (size, new_tokens] to the free list."""
    old_units, new_units = _units(allocator, allocator.size), _units(allocator, new_tokens)
    ids = torch.arange(old_units + 1, new_units + 1, dtype=torch.int64, device=allocator.device)
    allocator.free_pages = torch.cat((allocator.free_pages, ids))
    _set_size(allocator, new_tokens)


def shrink_allocator(allocator: Any, new_tokens: int) -> None:
    """Drop ids above `new_tokens`; refused unless every one of them is free."""
    if free_tail_start(allocator) > new_tokens:
        raise KVShrinkError(f"KV ids above {new_tokens} are not all free (free tail starts at "
                            f"{free_tail_start(allocator)})")
    keep = _units(allocator, new_tokens)
    allocator.free_pages = allocator.free_pages[allocator.free_pages <= keep]
    if getattr(allocator, "release_pages", None) is not None:
        allocator.release_pages = allocator.release_pages[allocator.release_pages <= keep]
    _set_size(allocator, new_tokens)


def _set_size(allocator: Any, tokens: int) -> None:
    allocator.size = tokens
    if allocator.page_size > 1:
        allocator.num_pages = tokens // allocator.page_size


# ---- the scheduler's copies of the size -----------------------------------------------------------

def publish_pool_size(scheduler: Any) -> dict[str, int]:
    """After the pool and allocator changed size, refresh every copy SGLang took by value (SIZE_COPIES),
    reading them back through SGLang's own accessors; returns the new values."""
    runner = scheduler.tp_worker.model_runner
    runner.max_total_num_tokens = int(runner.token_to_kv_pool.size)
    config = getattr(runner, "memory_pool_config", None)
    if config is not None and hasattr(config, "max_total_num_tokens"):
        config.max_total_num_tokens = runner.max_total_num_tokens
    with _quiet("sglang.srt.managers.tp_worker"):  # it warns when the pool is below the context length
        info = scheduler.tp_worker.get_worker_info()
    scheduler.max_total_num_tokens, scheduler.max_req_len, scheduler.max_req_input_len = info[0], info[4], info[5]
    widened = scheduler.max_total_num_tokens * getattr(scheduler, "kv_shard_widening", 1)
    for name, value in (("pool_stats_observer", widened), ("invariant_checker", widened),
                        ("load_inquirer", widened), ("kv_events_publisher", scheduler.max_total_num_tokens)):
        component = getattr(scheduler, name, None)
        if component is not None:
            # Two of these are frozen dataclasses that other components hold by reference, so the
            # field is rewritten in place: it is a by-value copy of a size that VAMP changes at run time.
            object.__setattr__(component, "max_total_num_tokens", value)
    return size_snapshots(scheduler)


def size_snapshots(scheduler: Any) -> dict[str, int]:
    """Every copy of the pool size as SGLang holds it now (all equal after a publish, bar the caps)."""
    runner = scheduler.tp_worker.model_runner
    out = {
        "allocator.size": int(scheduler.token_to_kv_pool_allocator.size),
        "token_to_kv_pool.size": int(runner.token_to_kv_pool.size),
        "model_runner.max_total_num_tokens": int(runner.max_total_num_tokens),
        "scheduler.max_total_num_tokens": int(scheduler.max_total_num_tokens),
        "scheduler.max_req_len": int(scheduler.max_req_len),
        "scheduler.max_req_input_len": int(scheduler.max_req_input_len),
    }
    for name in ("pool_stats_observer", "invariant_checker", "load_inquirer", "kv_events_publisher"):
        if getattr(scheduler, name, None) is not None:
            out[f"scheduler.{name}.max_total_num_tokens"] = int(getattr(scheduler, name).max_total_num_tokens)
    return out


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
