"""VAMP on hybrid linear-attention models (Qwen3-Next) inside SGLang 0.5.23: the two pools and their shortfalls.

SGLang keeps a hybrid model's memory in two pools. Full-attention KV lives in `HybridLinearKVPool`,
whose `full_kv_pool` is a plain `MHATokenToKVPool` over the full-attention layers only: VAMP lays
that pool over growable buffers exactly as for a dense-attention model (kv_pool.py), and a KV
shortfall reaches the usual decision point (`evict_to_free_tokens`). The linear-attention state
(conv and SSM state per request, plus checkpoints the prefix cache keeps) lives in the `MambaPool`
of `HybridReqToTokenPool`; a shortfall of state slots never passes through `evict_to_free_tokens`:
`ensure_mamba_capacity`, `_alloc_mamba_slot` and the copy-on-write of a matched state call
`UnifiedRadixCache.evict_for_alloc(EvictParams(mamba_num=n))`, which drops states in LRU order
(an internal node keeps its KV but can no longer end a match; a leaf goes with its KV). This
module is the decision point there: it counts each state shortfall, what it drops and the KV
tokens freed with it, for `/vamp/stats`.

Growing the state pool from expert pages is not done: `MambaPool` stores each state as one
layer-major tensor `[layers, slots + 1, ...]`, so new slots are not a tail of its memory (each
layer's slots are contiguous) and cannot be mapped in place the way KV rows are. A state shortfall
is therefore always covered by SGLang's own state eviction.

Configurations refused with VAMP on (by the launcher where a flag names them, else by `check_supported`
at scheduler start; both word them through vamp_sglang.hybrid_refusals), each with the reason: SGLang's
unified or QSA hybrid pools, MLA/DSA full attention, the extra-buffer state strategy (checkpoints
inside a sequence, GPU only), int8 state checkpoints and ReplaySSM rings (checkpoints that do not sit
at a node's end as the pricing assumes).
"""

from __future__ import annotations

from typing import Any

from vamp_sglang import hybrid_refusals
from vamp_sglang.integration.hooks import Hook


class UnsupportedHybridError(RuntimeError):
    """A hybrid configuration VAMP does not handle; the message names it and the way out."""


def is_hybrid(scheduler: Any) -> bool:
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    return isinstance(scheduler.req_to_token_pool, HybridReqToTokenPool)


def check_supported(kvcache: Any, req_to_token_pool: Any, tree_cache: Any) -> None:
    """Refuse hybrid pools and state strategies VAMP does not price or grow (see the module doc), as built;
    what a flag names is refused earlier by the launcher, in the same words (vamp_sglang.hybrid_refusals)."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool

    mamba = req_to_token_pool.mamba_pool
    problems = [
        (type(kvcache) is not HybridLinearKVPool, "pool", f"KV pool {type(kvcache).__name__}"),
        (type(getattr(kvcache, "full_kv_pool", None)) is not MHATokenToKVPool, "full_attention", ""),
        (bool(getattr(req_to_token_pool, "enable_mamba_extra_buffer", False))
         or bool(getattr(tree_cache, "enable_mamba_extra_buffer", False)), "extra_buffer", ""),
        (getattr(req_to_token_pool, "mamba_ckpt_pool", None) is not None, "int8_checkpoints", ""),
        (bool(getattr(mamba, "enable_linear_replayssm", False) or getattr(mamba, "enable_linear_replayssm_spec", False)),
         "replayssm", ""),
    ]
    for bad, feature, seen in problems:
        if bad:
            raise UnsupportedHybridError(hybrid_refusals.message(feature, seen))


class StatePool:
    """The linear-attention state pool as `/vamp/stats` shows it, and its shortfalls."""

    def __init__(self, req_to_token_pool: Any, tree_cache: Any) -> None:
        self.req_to_token_pool, self.tree_cache = req_to_token_pool, tree_cache
        self.shortfalls = 0  # evict_for_alloc calls that asked for state slots
        self.slots_short = 0  # state slots they asked for
        self.states_evicted = 0  # state checkpoints they dropped
        self.kv_tokens_freed = 0  # full-attention KV that went with them (leaves go whole)

    def on_shortfall(self, original: Any, cache: Any, params: Any, **kwargs: Any) -> Any:
        result = original(cache, params, **kwargs)
        self.shortfalls += 1
        self.slots_short += int(params.mamba_num)
        self.states_evicted += int(result.mamba_num_evicted)
        self.kv_tokens_freed += int(result.num_tokens_evicted)
        return result

    def _cached_states(self) -> int:
        # The cache's public sizes: the Rust tree core (stock, ratio 0) has no component_*_size_ dicts.
        return int(self.tree_cache.mamba_evictable_size() + self.tree_cache.mamba_protected_size())

    def stats(self) -> dict[str, Any]:
        allocator = self.req_to_token_pool.mamba_allocator
        return {"state_pool": {
            "slots": int(self.req_to_token_pool.mamba_pool.size),
            "free_slots": int(allocator.available_size()),
            "cached_states": self._cached_states(),
            "evictable_states": int(self.tree_cache.mamba_evictable_size()),
            "shortfalls": self.shortfalls, "slots_short": self.slots_short,
            "states_evicted": self.states_evicted, "kv_tokens_freed_with_states": self.kv_tokens_freed,
            "grows_from_experts": False}}


_state_pool: StatePool | None = None


def _around_evict_for_alloc(original: Any, cache: Any, params: Any, **kwargs: Any) -> Any:
    if _state_pool is None or not getattr(params, "mamba_num", 0) or cache is not _state_pool.tree_cache:
        return original(cache, params, **kwargs)
    return _state_pool.on_shortfall(original, cache, params, **kwargs)


HOOKS = [
    Hook("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict_for_alloc", "around",
         _around_evict_for_alloc, "the decision point of a linear-attention state-slot shortfall (hybrid models)"),
]


def setup_scheduler(scheduler: Any, runtime: Any) -> None:
    """Hybrid models only: refuse what VAMP does not support (VAMP on), then show the state pool."""
    global _state_pool
    if not is_hybrid(scheduler):
        return
    if runtime.config.enabled:
        check_supported(scheduler.token_to_kv_pool_allocator.get_kvcache(), scheduler.req_to_token_pool,
                        scheduler.tree_cache)
    _state_pool = StatePool(scheduler.req_to_token_pool, scheduler.tree_cache)
    runtime.extensions.append(_state_pool)
