"""Move cached KV rows off the pool's tail, so experts can come back while the prefix cache stays warm.

Restoring experts shrinks the KV pool from its tail, which is allowed only over free rows. After a
busy period the tail rows usually hold cached prefixes: evicting them would throw away exactly the
reuse VAMP exists to keep. Instead, while the scheduler is fully idle (no request holds a row, so
the radix tree is the only owner of every used row), each tail row the tree holds is copied to a
free row below the new size and the tree node's index is rewritten. Output is unchanged: the same
K/V bytes, at another row. Page size 1 only (the allocator's ids are rows).
"""

from __future__ import annotations

from typing import Any

import torch

from vamp_sglang.integration import radix


def compact_tail(tree_cache: Any, allocator: Any, keep_tokens: int) -> int:
    """Move every tree-held row above `keep_tokens` to a free row at or below it. All or nothing:
    returns the rows moved, or 0 (nothing changed) when there are not enough free low rows."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    if allocator.page_size != 1:
        return 0
    held = []
    for node in radix.tree_core_of(tree_cache).device_nodes():
        value = node.component_data[ComponentType.FULL].value
        if value is not None and value.numel():
            mask = value > keep_tokens
            if bool(mask.any()):
                held.append((value, mask))
    if not held:
        return 0
    src = torch.cat([value[mask] for value, mask in held])
    free = allocator.free_pages
    low = free[free <= keep_tokens]
    if low.numel() < src.numel():
        return 0
    dst = low[: src.numel()].to(src.dtype)
    pool = allocator.get_kvcache()
    for buffer in (*pool.k_buffer, *pool.v_buffer):  # [rows, heads, head_dim] per layer (NHD)
        buffer[dst] = buffer[src]
    offset = 0
    for value, mask in held:
        count = int(mask.sum())
        value[mask] = dst[offset: offset + count]
        offset += count
    allocator.free_pages = torch.cat([free[~torch.isin(free, dst)], src.to(free.dtype)])
    return int(src.numel())
