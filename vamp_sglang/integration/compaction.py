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

from typing import Any

import torch

from vamp_sglang.integration import kv_pool as pools
from vamp_sglang.integration import radix_tree


def _movable_tail(tree_cache: Any, keep_tokens: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(node id, its KV indices, mask of its rows above `keep_tokens`) for every unlocked tree node holding such
    rows: only the tree refers to those rows, so they may move while requests run."""
    held, hicache = [], _held_by_hicache(tree_cache)
    for node_id, value in radix_tree.tree_core_of(tree_cache).unlocked_device_values():
        if node_id in hicache or value is None or not value.numel():
            continue
        mask = value > keep_tokens
        if bool(mask.any()):
            held.append((node_id, value, mask))
    return held


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
    free = allocator.get_all_free_pages()
    used_above = (int(allocator.size) - keep_tokens) - int((free > keep_tokens).sum())
    return used_above == sum(int(mask.sum()) for _, _, mask in _movable_tail(tree_cache, keep_tokens))


def compact_tail(tree_cache: Any, allocator: Any, kv_pool: Any, keep_tokens: int) -> int:
    """Move every unlocked tree node's row above `keep_tokens` to a free row at or below it, in
    `kv_pool`, the MHATokenToKVPool (K and V rows) or MLATokenToKVPool (latent rows) whose buffers VAMP grows
    (on a hybrid model the allocator serves its HybridLinearKVPool wrapper; the rows are the full-attention
    pool's). All or nothing: returns the
    rows moved, or 0 (nothing changed) when there are not enough free low rows."""
    if allocator.page_size != 1:
        return 0
    held = _movable_tail(tree_cache, keep_tokens)
    if not held:
        return 0
    src = torch.cat([value[mask] for _, value, mask in held])
    free = allocator.get_all_free_pages()  # the sorted free list and the lazily released ids
    low = free[free <= keep_tokens]
    if low.numel() < src.numel():
        return 0
    dst = low[: src.numel()].to(src.dtype)
    for buffer in pools.sglang_buffers(kv_pool):  # [rows, heads, head_dim] per layer (NHD; MLA: heads 1)
        buffer[dst] = buffer[src]
    offset = 0
    for _, value, mask in held:  # in place: the tree's own index tensor (SGLang's Rust core hands out its own too)
        count = int(mask.sum())
        value[mask] = dst[offset: offset + count]
        offset += count
    allocator.free_pages = torch.cat([free[~torch.isin(free, dst)], src.to(free.dtype)])
    if allocator.release_pages is not None:
        allocator.release_pages = allocator.release_pages[:0]  # merged into free_pages above
    return int(src.numel())
