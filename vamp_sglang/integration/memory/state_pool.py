"""SGLang's linear-attention state pool (hybrid models) laid over growable buffers, and its size.

Paper IV-C on Qwen3-Next: a state-slot shortfall can be covered by expert memory as a KV shortfall
is. SGLang 0.5.23's `MambaPool` holds `mamba_cache.conv[i]` and `mamba_cache.temporal`, each one
`[layers, slots + 1, ...]` tensor (slot 0 pads), and `MambaSlotAllocator` a free list of ids
`1..size`. This module

- re-points those tensor objects at `GrowableStateBuffers` (each layer's slots grow at its own tail);
- grows the pool by appending ids to the free list, or shrinks it over free tail ids, and keeps the
  two copies of the size (`MambaPool.size`, `MambaSlotAllocator.size`) equal; everything else in
  SGLang reads them live;
- moves cached states out of the tail before a shrink (`compact`): a state the tree holds for a
  prefix, whose node no request has locked, is copied to a free lower slot and the node re-pointed.

Only SGLang's plain layout is laid out (`check_state_pool`): envelope, ReplaySSM and side-state pools keep
more per-slot tensors than the two kinds here. A speculative pool (an MTP draft's verify) adds
`intermediate_ssm` and `intermediate_conv_window`, the state after each draft token, but one row per running
request (batch position; `spec_state_size + 1` rows = max running requests + 1, mem_cache/
kv_cache_configurator.py:1718-1721 and layers/attention/linear/utils.py:125-155), not per slot: growing the
slots leaves them as they are, which `check_state_pool` confirms from their row count.
"""

from __future__ import annotations

from typing import Any

import torch

from vamp_sglang.integration.memory.kv_pool import free_ids_tail_start
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.kv_buffers import KVShrinkError
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.state_buffers import GrowableStateBuffers, StateKind, pages_for, rows_for_pages

_CACHED = ("_conv_fuse_ok", "_conv_slot_desc")  # MambaPool cached_properties over the old tensors


class UnsupportedStatePoolError(RuntimeError):
    """A state pool VAMP cannot grow; the message says which and the way out."""


def per_request_rows(cache: Any, requests: int) -> list[str]:
    """The speculative per-draft-token tensors that are NOT one row per running request (plus a padding row),
    by name: state VAMP would have to grow with the slots, which it does not."""
    if not hasattr(cache, "intermediate_ssm"):
        return []
    tensors = [("intermediate_ssm", cache.intermediate_ssm),
               *(("intermediate_conv_window", t) for t in cache.intermediate_conv_window)]
    return [name for name, t in tensors if t is not None and int(t.shape[1]) != requests + 1]


def check_state_pool(mamba_pool: Any, requests: int) -> None:
    """What the launcher cannot see in the flags is refused here, when the pool is built (before serving);
    `requests` is the request pool's size (SGLang's max running requests)."""
    cache = mamba_pool.mamba_cache
    per_slot = per_request_rows(cache, requests)
    problems = [
        (bool(per_slot), f"per-draft-token state sized by slots, not requests ({', '.join(per_slot)})"),
        (getattr(mamba_pool, "_raw", None) is not None, "the envelope state layout"),
        (any(getattr(cache, f"replayssm_{n}", None) is not None for n in ("d", "k", "g")), "ReplaySSM rings"),
        (bool(mamba_pool._slot_siblings), "side states riding on the slots"),
        (any(not t.is_contiguous() for t in state_tensors(mamba_pool)), "a non-contiguous state layout"),
    ]
    for bad, what in problems:
        if bad:
            raise UnsupportedStatePoolError(f"VAMP cannot grow this linear-attention state pool: {what}; "
                                            f"run with --vamp-max-offload-ratio 0")


def state_tensors(mamba_pool: Any) -> list[torch.Tensor]:
    """The pool's `[layers, slots + 1, ...]` state tensors in GrowableStateBuffers' kind order."""
    cache = mamba_pool.mamba_cache
    return [*cache.conv, cache.temporal]


class GrowableStatePool:
    """A `MambaPool` whose state tensors are views of `GrowableStateBuffers` rows."""

    def __init__(self, req_to_token_pool: Any, buffers: GrowableStateBuffers) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.mamba_pool, self.allocator = req_to_token_pool.mamba_pool, req_to_token_pool.mamba_allocator
        self.buffers = buffers
        self.baseline_slots = int(self.mamba_pool.size)
        for k, tensor in enumerate(state_tensors(self.mamba_pool)):
            buffers.view_into(tensor, k, self.baseline_slots + 1)
            tensor.zero_()
        _drop_cached(self.mamba_pool)

    @property
    def slots(self) -> int:
        return int(self.mamba_pool.size)

    def free_tail_start(self) -> int:
        """Smallest slot count s such that every id above s is free (the pool could shrink to s now)."""
        return free_ids_tail_start(self.allocator.free_slots, self.slots)

    def resize(self, new_slots: int) -> None:
        """SGLang's pool becomes `new_slots` slots, over rows the buffers map already; a shrink is
        refused (KVShrinkError, nothing changed) unless every dropped id is free."""
        old = self.slots
        if new_slots + 1 > self.buffers.rows:
            raise KVShrinkError(f"{new_slots} state slots need {new_slots + 1} rows, {self.buffers.rows} are mapped")
        if new_slots < old and self.free_tail_start() > new_slots:
            raise KVShrinkError(f"state slots above {new_slots} are not all free "
                                f"(free tail starts at {self.free_tail_start()})")
        for k, tensor in enumerate(state_tensors(self.mamba_pool)):
            self.buffers.view_into(tensor, k, new_slots + 1)
            if new_slots > old:
                tensor[:, old + 1:].zero_()  # the pages held expert bytes a moment ago
        free = self.allocator.free_slots
        if new_slots < old:
            self.allocator.free_slots = free[free <= new_slots]
        else:
            ids = torch.arange(old + 1, new_slots + 1, dtype=free.dtype, device=free.device)
            self.allocator.free_slots = torch.cat((free, ids))
        self.mamba_pool.size = self.allocator.size = new_slots

    def tail_is_movable(self, tree_cache: Any, keep_slots: int) -> bool:
        """Whether `compact(keep_slots)` can free every id above keep_slots: each used one is a cached
        state of an unlocked tree node, and enough free ids lie below."""
        moves = self._tail_states(tree_cache, keep_slots)
        free_below = int((self.allocator.free_slots <= keep_slots).sum())
        used_above = self.slots - keep_slots - (len(self.allocator.free_slots) - free_below)
        return moves is not None and len(moves) == used_above and free_below >= len(moves)

    def compact(self, tree_cache: Any, keep_slots: int) -> int:
        """Move the cached states above keep_slots to free ids below it; returns how many moved.
        Call only where `tail_is_movable` holds and no forward runs (between scheduler steps)."""
        moves = self._tail_states(tree_cache, keep_slots)
        if not moves:
            return 0
        free = self.allocator.free_slots
        low = free[free <= keep_slots][:len(moves)]
        src = torch.cat([value for _, value in moves]).to(free.device)
        self.mamba_pool.copy_from(src, low)
        for (data, _), dst in zip(moves, low.split(1)):
            data.value = dst.to(data.value.device, data.value.dtype)
        self.allocator.free_slots = torch.cat((free[~torch.isin(free, low)], src.to(free.dtype)))
        return len(moves)

    def stats(self) -> dict[str, int]:
        return {"baseline_slots": self.baseline_slots, "buffer_rows": self.buffers.rows}

    def _tail_states(self, tree_cache: Any, keep_slots: int) -> list[tuple[Any, torch.Tensor]] | None:
        """(component data, slot tensor) of every cached state above keep_slots; None if one of them
        sits on a locked node (a request may read it)."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        out, stack = [], [tree_cache.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            data = node.component_data[ComponentType.MAMBA]
            if data.value is None or int(data.value[0]) <= keep_slots:
                continue
            if data.lock_ref > 0:
                return None
            out.append((data, data.value))
        return out


def _drop_cached(mamba_pool: Any) -> None:
    for name in _CACHED:  # they were built over the tensors SGLang allocated
        mamba_pool.__dict__.pop(name, None)


def release_state_tensors(mamba_pool: Any) -> None:
    """Give the device memory of SGLang's state tensors back to the driver before their pages are
    created again: SGLang sized the KV pool with these bytes counted once, and the KV buffers' pages
    (`cuMemCreate`) cannot use blocks torch's caching allocator keeps (issue 19 item 4)."""
    _drop_cached(mamba_pool)
    tensors = state_tensors(mamba_pool)
    for tensor in tensors:
        tensor.set_()  # the same object, empty: nothing holds SGLang's allocation any more
    if any(t.device.type == "cuda" for t in tensors):
        torch.cuda.empty_cache()


def lay_state_pool_over_growable(req_to_token_pool: Any, backend: PageBackend,
                                 layout: ExpertLayout) -> GrowableStatePool:
    """Re-point SGLang's state tensors at reservations that can hold the whole offload bound's pages,
    built after SGLang's own allocation went back to the driver (the pool starts zeroed, as SGLang's)."""
    mamba_pool = req_to_token_pool.mamba_pool
    check_state_pool(mamba_pool, int(req_to_token_pool.size))
    kinds = [StateKind(tuple(t.shape[2:]), t.dtype) for t in state_tensors(mamba_pool)]
    layers, rows = int(mamba_pool.mamba_cache.temporal.shape[0]), int(mamba_pool.size) + 1
    release_state_tensors(mamba_pool)
    gran = backend.granularity_bytes
    budget = pages_for(kinds, layers, gran, rows) + layout.bound_groups * layout.pages_freed_per_group
    most = rows + budget * gran // min(k.slot_bytes for k in kinds)  # a cap rows_for_pages never reaches
    buffers = GrowableStateBuffers(backend, kinds, layers, rows, rows_for_pages(kinds, layers, gran, budget, most))
    return GrowableStatePool(req_to_token_pool, buffers)
