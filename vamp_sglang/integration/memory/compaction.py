"""Move cached KV rows off the pool's tail, so experts can come back while the prefix cache stays warm.

Restoring experts shrinks the KV pool from its tail, which is allowed only over free rows. After a
busy period the tail rows usually hold cached prefixes: evicting them would throw away exactly the
reuse VAMP exists to keep. Instead, each tail row held by an unlocked tree node (no running request
uses it: the tree is its only owner) is copied to a free row below the new size and the node's
index is rewritten. That works while requests run, as long as none of them holds a tail row
(`tail_is_movable`). Output is unchanged: the same K/V bytes, at another row. Page size 1 only
(the allocator's ids are rows).

With HiCache a node HiCache holds a host copy of (`backuped`), is writing to host or loading from it keeps
its rows (`_held_by_hicache`): its in-flight transfers captured the device rows when they were submitted.
Such a tail is not movable; the restore waits or evicts instead (docs/hicache.md).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from vamp_sglang.integration.memory import kv_pool as pools


def _unlocked_nodes(tree_cache: Any) -> list[tuple[int, torch.Tensor]]:
    """(node id, its KV indices) of every unlocked tree node that holds rows and no HiCache transfer holds."""
    # imported here: it imports SGLang, and eval/gpu_check.py times this module on a machine without SGLang
    from vamp_sglang.integration.cache import radix_tree

    hicache = _held_by_hicache(tree_cache)
    core = radix_tree.tree_core_of(tree_cache)
    return [(node_id, value) for node_id, value in core.unlocked_device_values()
            if node_id not in hicache and value is not None and value.numel()]


def _movable_tail(tree_cache: Any, keep_tokens: int) -> list[tuple[int, torch.Tensor, torch.Tensor, int]]:
    """(node id, its KV indices, mask of its rows above `keep_tokens`, how many) for every unlocked tree node
    holding such rows: only the tree refers to those rows, so they may move while requests run.

    One batched reduction and one host read for the whole tree: on a GPU the indices are device tensors, and a
    reduction read back per node is one blocking stream sync each (10^4-10^5 nodes: a scheduler stall of
    0.1-2 s per restore attempt, and the overlap lost for that step)."""
    nodes = _unlocked_nodes(tree_cache)
    if not nodes:
        return []
    values = [value for _, value in nodes]
    lengths = [value.numel() for value in values]  # metadata: no device read
    above = torch.cat(values) > keep_tokens
    ends = _on_device(list(itertools.accumulate(lengths)), above.device) - 1
    at_ends = above.cumsum(0)[ends]  # rows above keep_tokens up to the end of each node
    counts = torch.diff(at_ends, prepend=at_ends.new_zeros(1)).tolist()  # the one host read
    masks = torch.split(above, lengths)  # views
    return [(node_id, value, mask, count)
            for (node_id, value), mask, count in zip(nodes, masks, counts, strict=True) if count]


def _on_device(numbers: list[int], device: torch.device) -> torch.Tensor:
    """`numbers` as an int64 tensor on `device`; to CUDA from pinned memory without blocking (a copy from
    pageable memory would synchronise the stream: another blocking wait)."""
    host = torch.tensor(numbers, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _held_by_hicache(tree_cache: Any) -> set[int]:
    """Ids of the nodes HiCache is writing to host or loading back (UnifiedRadixCache.ongoing_*; none without
    HiCache)."""
    ids: set[int] = set()
    for write in getattr(tree_cache, "ongoing_write_through", {}).values():
        ids.add(write.node_id)
        ids.update(write.publish_node_ids)
    ids.update(load.node_id for load in getattr(tree_cache, "ongoing_load_back", {}).values())
    return ids


def tail_is_movable(tree_cache: Any, allocator: Any, keep_tokens: int) -> bool:
    """Whether every used row above `keep_tokens` belongs to an unlocked tree node (page size 1):
    then eviction and compaction can free the tail without touching a running request."""
    if allocator.page_size != 1:
        return False
    return used_tail_is_in(allocator, [value for _, value in _unlocked_nodes(tree_cache)], keep_tokens)


def used_tail_is_in(allocator: Any, values: list[torch.Tensor], keep_tokens: int) -> bool:
    """Whether the allocator's used rows above `keep_tokens` are exactly those in `values` (the nodes' KV
    indices). Each restore attempt asks this: one batched reduction over every node and one host read."""
    free = allocator.get_all_free_pages()
    movable = (torch.cat(values) > keep_tokens).sum().to(free.device) if values \
        else torch.zeros((), dtype=torch.int64, device=free.device)
    # the one host read
    free_above, movable_rows = torch.stack([(free > keep_tokens).sum(), movable]).tolist()
    return (int(allocator.size) - keep_tokens) - free_above == movable_rows


def compact_tail(tree_cache: Any, allocator: Any, kv_pools: Any, keep_tokens: int) -> int:
    """Move every unlocked tree node's row above `keep_tokens` to a free row at or below it, in
    `kv_pools`, the MHATokenToKVPool (K and V rows) or MLATokenToKVPool (latent rows) whose buffers VAMP grows
    (on a hybrid model the allocator serves its HybridLinearKVPool wrapper; the rows are the full-attention
    pool's), or a list of it and the speculative draft's pools, whose rows the same token ids name.
    All or nothing: returns the rows moved, or 0 (nothing changed) when there are not enough free low rows."""
    if allocator.page_size != 1:
        return 0
    held = _movable_tail(tree_cache, keep_tokens)
    if not held:
        return 0
    rows = sum(count for *_, count in held)
    free = allocator.get_all_free_pages()  # the sorted free list and the lazily released ids
    low = free[free <= keep_tokens]
    if low.numel() < rows:
        return 0
    values = [value for _, value, _, _ in held]
    index = torch.cat(values)  # a copy: rewritten below, then written back
    where = torch.cat([mask for _, _, mask, _ in held]).nonzero_static(size=rows).squeeze(1)  # no host read
    src = index[where]
    dst = low[:rows].to(src.dtype)
    every_pool = kv_pools if isinstance(kv_pools, (list, tuple)) else [kv_pools]
    for buffer in [b for pool in every_pool for b in pools.sglang_buffers(pool)]:  # [rows, heads, head_dim]
        buffer[dst] = buffer[src]
    index[where] = dst
    for value, moved in zip(values, torch.split(index, [value.numel() for value in values]), strict=True):
        value.copy_(moved)  # in place: the tree's own index tensor (SGLang's Rust core hands out its own too)
    allocator.free_pages = torch.cat([free[~torch.isin(free, dst)], src.to(free.dtype)])
    if allocator.release_pages is not None:
        allocator.release_pages = allocator.release_pages[:0]  # merged into free_pages above
    return int(src.numel())
