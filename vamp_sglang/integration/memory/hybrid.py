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
module is the decision point there (paper IV-B, in state slots): with VAMP on, the same planner
prices the two ways to cover the n slots short, in slots instead of tokens:
- evict: the states SGLang would drop, in its order, each at C_c (Eq. 2) of the KV it makes no
  match reach (`radix_eviction.state_eviction_candidates`);
- offload: the fewest groups whose pages give the state pool n slots (`ExpertMemory.slots_for`,
  state_pool.py lays the state tensors over growable buffers), at C_o (Eq. 3);
- combined: offload what stays below n, evict the rest. Preempting is not an option here: SGLang
  asserts when a state slot cannot be found.
The TP ranks agree on the groups and slots as for a KV offload; SGLang then evicts only what is
still short. Whatever fails in our code falls back to SGLang's eviction for that shortfall.

Configurations refused with VAMP on (by the launcher where a flag names them, else by `check_supported`
at scheduler start; both word them through vamp_sglang.refusals.hybrid), each with the reason: SGLang's
unified or QSA hybrid pools, MLA/DSA full attention, the extra-buffer state strategy (checkpoints
inside a sequence, GPU only), int8 state checkpoints and ReplaySSM rings (checkpoints that do not sit
at a node's end as the pricing assumes).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import time
import zlib
from collections import Counter
from typing import Any

from vamp_sglang.integration.hooks import Hook
from vamp_sglang.policy import Snapshot, plan
from vamp_sglang.refusals import hybrid as hybrid_refusals

logger = logging.getLogger(__name__)
_deciding: contextvars.ContextVar[bool] = contextvars.ContextVar("vamp_state_deciding", default=False)


class UnsupportedHybridError(RuntimeError):
    """A hybrid configuration VAMP does not handle; the message names it and the way out."""


def is_hybrid(scheduler: Any) -> bool:
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    return isinstance(scheduler.req_to_token_pool, HybridReqToTokenPool)


def check_supported(kvcache: Any, req_to_token_pool: Any, tree_cache: Any) -> None:
    """Refuse hybrid pools and state strategies VAMP does not price or grow (see the module doc), as built;
    what a flag names is refused earlier by the launcher, in the same words (vamp_sglang.refusals.hybrid)."""
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
    """The linear-attention state pool as `/vamp/stats` shows it, its shortfalls and their decisions."""

    def __init__(self, req_to_token_pool: Any, tree_cache: Any, runtime: Any) -> None:
        self.req_to_token_pool, self.tree_cache, self.runtime = req_to_token_pool, tree_cache, runtime
        self.shortfalls = 0  # evict_for_alloc calls that asked for state slots
        self.slots_short = 0  # state slots they asked for
        self.states_evicted = 0  # state checkpoints they dropped
        self.kv_tokens_freed = 0  # full-attention KV that went with them (leaves go whole)
        self.slots_added = 0  # state slots offloading added at shortfalls
        self.decisions: Counter[str] = Counter()  # plan actions at state shortfalls (VAMP on)
        self.errors = 0

    def on_shortfall(self, original: Any, cache: Any, params: Any, **kwargs: Any) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult

        gap = int(params.mamba_num)
        self.shortfalls += 1
        self.slots_short += gap
        added = self._decide(gap) if "allocation_reclaim_satisfied" not in kwargs else 0
        if added >= gap:
            return EvictResult()  # the pool grew by the whole shortfall: nothing to evict
        if added:
            params = dataclasses.replace(params, mamba_num=gap - added)  # SGLang targets free + request
        result = original(cache, params, **kwargs)
        self.states_evicted += int(result.mamba_num_evicted)
        self.kv_tokens_freed += int(result.num_tokens_evicted)
        return result

    def _decide(self, gap: int) -> int:
        """Plan the shortfall (in slots) and carry out its offload; returns the slots added."""
        from vamp_sglang.integration.cache import radix_eviction

        maker = self._maker()
        memory = maker.memory if maker is not None else None
        if memory is None or memory.states is None or _deciding.get():
            return 0
        token = _deciding.set(True)  # SGLang's eviction re-enters evict_for_alloc
        start, snapshot, chosen = time.perf_counter(), None, None
        try:
            try:
                view = self._offer(maker)
                free = int(self.req_to_token_pool.mamba_allocator.available_size())
                snapshot = Snapshot(
                    site="prefill", gap_tokens=gap, free_tokens=free,
                    evictable=tuple(radix_eviction.state_eviction_candidates(self.tree_cache, gap)),
                    offload=maker.offload_state(view, None), preempt=(), retract_buffer_tokens=0,
                    observed_hit_rate=self.runtime.ledger.hit_rate,
                    coefficients=maker.inputs.coefficients().as_overrides(),
                    tpot_guard_groups=maker.inputs.guard_cap_groups())
                chosen = plan(snapshot, maker.base_coefficients, maker.config.policy)
            except Exception:  # a decision error must never reach SGLang's cache
                self.errors += 1
                logger.exception("vamp: state-shortfall decision failed; SGLang's own eviction covers it")
            groups = chosen.groups if chosen is not None and chosen.action != "evict" else 0
            added = maker.offload(groups, to_state=True)
            if groups and not added:  # counted as a failed KV offload is
                maker.counts["offload_failures"] += 1
            if added:
                self.slots_added += added
                self.runtime.publish_metrics()
            if chosen is not None:
                self.decisions["combined" if chosen.action == "partial" else chosen.action] += 1
                decide_s = time.perf_counter() - start
                maker.record(lambda: maker.log.record(
                    step=self.runtime.step, site="state", policy=maker.config.policy, snapshot=snapshot,
                    plan=chosen, decide_s=decide_s, outcome={"slots_added": added, "state_slots": memory.states.slots}))
            return added
        finally:
            _deciding.reset(token)

    @staticmethod
    def _offer(maker: Any) -> tuple[int, ...]:
        """Slots 1, 2, ... more groups add to the state pool, the same on every rank (else none offered)."""
        memory = maker.memory
        headroom = maker.inputs.offer().headroom_groups  # 0 while offloading is backed off or blocked
        local = tuple(memory.slots_for(n) for n in range(1, headroom + 1))
        if not maker.rounds.all_equal(zlib.crc32(repr(local).encode()) & 0x7FFFFFFF, purpose="state-view"):
            return ()
        return local

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
            "slots_added": self.slots_added, "decisions": dict(self.decisions), "decision_errors": self.errors,
            "grows_from_experts": self._grows()}}

    def _maker(self) -> Any:
        """The decision maker (VAMP on), or None (VAMP off, or a cache built without a runtime)."""
        return getattr(self.runtime, "decision_maker", None)

    def _grows(self) -> bool:
        maker = self._maker()
        return maker is not None and maker.memory.states is not None


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
    _state_pool = StatePool(scheduler.req_to_token_pool, scheduler.tree_cache, runtime)
    runtime.extensions.append(_state_pool)
