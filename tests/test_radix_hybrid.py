"""VAMP on a hybrid linear-attention model (Qwen3-Next) without a server: what SGLang's hybrid prefix
cache can reuse and how our tree prices its eviction (pure, then on SGLang's real CPU objects:
HybridReqToTokenPool, MambaPool, HybridLinearKVPool, UnifiedRadixCache with a MAMBA component),
the state-slot decision point, and the configurations refused at start. The full-attention pool's
growth under its hybrid wrapper is tested with the other pool growth in test_integration_memory.py
(this module sorts after it: its context fixture resets SGLang's parallel state)."""

from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from tests.test_radix_tree_state import sglang_context  # noqa: F401 (fixture)
from vamp_sglang.cache.hybrid import tokens_losing_reuse
from vamp_sglang.integration.cache import radix_backend, radix_eviction, radix_tree
from vamp_sglang.integration.memory import hybrid
from vamp_sglang.policy import Coefficients, EvictableBlock, OffloadState, Snapshot, plan

# ---- pure: the reuse rule --------------------------------------------------------------------------


class DictTree:
    """name -> (parent, tokens, has_state)."""

    def __init__(self, nodes):
        self.nodes = nodes

    def parent(self, n):
        return self.nodes[n][0]

    def children(self, n):
        return [c for c, (p, _, _) in self.nodes.items() if p == n]

    def tokens(self, n):
        return self.nodes[n][1]

    def has_state(self, n):
        return self.nodes[n][2]


# a [10, state] -> b [5, no state: split point] -> c [20, state] and d [7, state]; e [3, no state] under a
TREE = DictTree({"a": (None, 10, True), "b": ("a", 5, False), "c": ("b", 20, True), "d": ("b", 7, True),
                 "e": ("a", 3, False)})


def test_a_stateless_leaf_loses_nothing_and_a_leaf_takes_its_stateless_ancestors_along():
    assert tokens_losing_reuse(TREE, "e") == 0  # no match can end in it
    assert tokens_losing_reuse(TREE, "c") == 20  # b stays reachable through d
    assert tokens_losing_reuse(TREE, "d", gone={"c"}) == 7 + 5  # b has no state left below it
    assert tokens_losing_reuse(TREE, "a", gone={"b", "c", "d", "e"}) == 10


def test_planner_prices_dead_nodes_at_zero_and_live_ones_by_what_they_lose():
    """The same 40 KV tokens: free when no match can reach them, Eq. 2 on the lost tokens otherwise."""
    def snapshot(lost):
        return Snapshot(site="prefill", gap_tokens=30, free_tokens=0,
                        evictable=(EvictableBlock(40, 3, 1, 1.0, reprefill_tokens=lost),),
                        offload=OffloadState(1, (64,), 2, 128, 2, 100), preempt=(), retract_buffer_tokens=0,
                        observed_hit_rate=1.0)
    c = Coefficients()
    assert plan(snapshot(0), c).costs["evict"] == 0.0
    assert plan(snapshot(0), c).action == "evict"
    assert plan(snapshot(60), c).costs["evict"] > plan(snapshot(40), c).costs["evict"] > 0
    assert Snapshot.from_json(snapshot(0).to_json()) == snapshot(0)
    assert "reprefill_tokens" not in Snapshot.from_json(snapshot(None).to_json()).to_json()["evictable"][0]


# ---- SGLang's real hybrid cache -------------------------------------------------------------------

STATE_SLOTS = 6


def state_params():
    return SimpleNamespace(shape=SimpleNamespace(conv=[(3, 8)], temporal=(1, 4, 8)), is_kda=False, layers=[0, 1, 2],
                           dtype=SimpleNamespace(conv=torch.bfloat16, temporal=torch.float32))


def req_pool():
    return HybridReqToTokenPool(size=4, mamba_size=STATE_SLOTS, mamba_spec_state_size=4, max_context_len=256,
                                device="cpu", enable_memory_saver=False, cache_params=state_params(),
                                mamba_layer_ids=[0, 1, 2], enable_mamba_extra_buffer=False,
                                enable_overlap_schedule=False)


def build_hybrid_cache():
    reqs = req_pool()
    kv = HybridLinearKVPool(size=64, dtype=torch.float16, page_size=1, head_num=1, head_dim=4,
                            full_attention_layer_ids=[3], device="cpu", mamba_pool=reqs.mamba_pool)
    alloc = TokenToKVPoolAllocator(64, torch.float16, "cpu", kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=reqs, token_to_kv_pool_allocator=alloc, page_size=1,
                             tree_components=(ComponentType.FULL, ComponentType.MAMBA), eviction_policy="vamp",
                             tree_core_backend=radix_backend.NAME)
    return radix_tree.VampUnifiedRadixCache(params), alloc, reqs


def key(tokens):
    return RadixKey(array("q", tokens))


def insert(cache, alloc, reqs, tokens):
    cache.insert(InsertParams(key=key(tokens), value=alloc.alloc(len(tokens)), mamba_value=reqs.mamba_allocator.alloc(1)))


def matched(cache, tokens):
    return cache.match_prefix(MatchPrefixParams(key=key(tokens))).device_prefix_len


@pytest.fixture
def tree():
    """[0..4] (split point, no state) -> [5..9] (state) -> [50..52] (state); [0..4] -> [99, 98] (state)."""
    cache, alloc, reqs = build_hybrid_cache()
    insert(cache, alloc, reqs, list(range(10)))
    insert(cache, alloc, reqs, [*range(10), 50, 51, 52])
    insert(cache, alloc, reqs, [0, 1, 2, 3, 4, 99, 98])
    return cache, alloc, reqs


def test_sglang_matches_only_down_to_the_deepest_state(tree):
    cache, _, _ = tree
    assert matched(cache, [*range(10), 50, 51, 52, 53]) == 13
    assert matched(cache, [0, 1, 2, 3, 4, 7]) == 0  # the split point holds KV but no state


def test_candidates_carry_the_tokens_each_eviction_makes_unreachable(tree):
    cache, _, _ = tree
    got = [(b.tokens, b.reprefill_tokens) for b in radix_eviction.eviction_candidates(cache, 100, 0, 1, 0)]
    # [50..52]; then [5..9] ([0..4] still reachable via [99, 98]); then [99, 98] with [0..4]; then [0..4], dead
    assert got == [(3, 3), (5, 5), (2, 7), (5, 0)]


def test_dead_kv_goes_first_and_the_walk_predicts_sglangs_eviction(tree):
    """After SGLang's state eviction drops every state, the remaining KV is dead: priced 0, evicted first."""
    cache, alloc, _ = tree
    cache.evict(EvictParams(num_tokens=0, mamba_num=3))
    candidates = radix_eviction.eviction_candidates(cache, 100, 0, 1, 0)
    assert candidates and all(b.reprefill_tokens == 0 for b in candidates)
    insert(cache, alloc, tree[2], [7, 7, 7, 7])  # a live leaf next to the dead ones
    predicted = radix_eviction.eviction_plan(cache, 5)
    assert predicted.cost_s == 0.0 and all(not radix_tree.tree_core_of(cache).has_state(n) for n in predicted.nodes)
    free = alloc.available_size()
    cache.evict(EvictParams(num_tokens=5))
    assert alloc.available_size() - free == predicted.tokens
    assert matched(cache, [7, 7, 7, 7, 1]) == 4  # the live prefix survived


def test_a_state_shortfall_is_counted_at_its_decision_point(tree, monkeypatch):
    cache, _, reqs = tree
    pool = hybrid.StatePool(reqs, cache, runtime=None)  # VAMP off: counted, SGLang evicts
    monkeypatch.setattr(hybrid, "_state_pool", pool)
    before = pool.stats()["state_pool"]
    assert (before["slots"], before["cached_states"], before["free_slots"]) == (STATE_SLOTS, 3, STATE_SLOTS - 3)
    hybrid._around_evict_for_alloc(type(cache).evict_for_alloc, cache, EvictParams(num_tokens=0, mamba_num=4))
    hybrid._around_evict_for_alloc(type(cache).evict_for_alloc, cache, EvictParams(num_tokens=1))  # KV: not ours
    after = pool.stats()["state_pool"]
    assert (after["shortfalls"], after["slots_short"]) == (1, 4)
    assert after["states_evicted"] == 3 - after["cached_states"] > 0
    assert after["kv_tokens_freed_with_states"] > 0 and after["grows_from_experts"] is False


def test_the_supported_configuration_passes_and_others_are_refused(tree):
    cache, alloc, reqs = tree
    hybrid.check_supported(alloc.get_kvcache(), reqs, cache)
    with pytest.raises(hybrid.UnsupportedHybridError, match="needs HybridLinearKVPool"):
        hybrid.check_supported(alloc.get_kvcache().full_kv_pool, reqs, cache)
    reqs.enable_mamba_extra_buffer = True
    with pytest.raises(hybrid.UnsupportedHybridError, match="no_buffer.*--vamp-max-offload-ratio 0"):
        hybrid.check_supported(alloc.get_kvcache(), reqs, cache)




def test_compaction_moves_cached_rows_under_the_hybrid_wrapper(tree):
    """Restore compacts cached KV off the pool's tail (integration/memory/compaction.py). On a hybrid model the
    allocator's cache is HybridLinearKVPool, whose K/V live in its full-attention pool: the moved rows keep
    their bytes there, the tree points at them, and every prefix still matches (found by a hybrid soak:
    every restore failed with an AttributeError)."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType as Component

    from vamp_sglang.integration.memory import compaction

    cache, alloc, reqs = tree
    full = alloc.get_kvcache().full_kv_pool
    buffers = (*full.k_buffer, *full.v_buffer)
    for layer, buffer in enumerate(buffers):  # row r of buffer l holds r * (l + 1): where a row came from
        buffer.copy_(torch.arange(buffer.shape[0], dtype=buffer.dtype)[:, None, None] * (layer + 1))
    free_rows = alloc.alloc(alloc.available_size()).sort().values
    alloc.free(free_rows[:-7])  # a busy past: two prefixes cached in the pool's top 7 rows
    for tokens, rows in (([5, 5, 5], free_rows[-7:-4]), ([6, 6, 6, 6], free_rows[-4:])):
        cache.insert(InsertParams(key=key(tokens), value=rows, mamba_value=reqs.mamba_allocator.alloc(1)))
    values = [n.component_data[Component.FULL].value for n in radix_tree.tree_core_of(cache).device_nodes()]
    rows_before = [v.clone() for v in values if v is not None]
    keep_tokens = 40
    assert compaction.tail_is_movable(cache, alloc, keep_tokens)
    assert compaction.compact_tail(cache, alloc, full, keep_tokens) == 7
    rows_after = [v for v in values if v is not None]
    assert all(int(v.max()) <= keep_tokens for v in rows_after if v.numel())
    for before, after in zip(rows_before, rows_after, strict=True):
        for layer, buffer in enumerate(buffers):
            assert torch.equal(buffer[after, 0, 0], (before * (layer + 1)).to(buffer.dtype))
    assert int((alloc.get_all_free_pages() > keep_tokens).sum()) == int(alloc.size) - keep_tokens
    assert matched(cache, [5, 5, 5, 1]) == 3 and matched(cache, [*range(10), 50, 51, 52, 1]) == 13


def test_state_candidates_follow_sglangs_state_eviction(tree):
    """The first state SGLang drops is the least recent one, [5..9]: an inner node, so its KV stays but a
    request resuming there re-prefills back to the root (its parent [0..4] holds no state)."""
    cache, _, _ = tree
    got = [(b.tokens, b.reprefill_tokens) for b in radix_eviction.state_eviction_candidates(cache, 3)]
    # then the leaf [50..52], taking [5..9] along (no state left there), then [99, 98] with [0..4]
    assert got == [(1, 10), (1, 8), (1, 7)]
    cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
    assert matched(cache, list(range(10))) == 0 and matched(cache, [*range(10), 50, 51, 52, 9]) == 13


# ---- the state pool over growable buffers ---------------------------------------------------------

def laid_out_cache(backend):
    """The fixture's tree, with its state tensors laid over growable host pages before any state exists."""
    from vamp_sglang.integration.memory.state_pool import GrowableStatePool, state_tensors
    from vamp_sglang.memory.state_buffers import GrowableStateBuffers, StateKind

    cache, alloc, reqs = build_hybrid_cache()
    kinds = [StateKind(tuple(t.shape[2:]), t.dtype) for t in state_tensors(reqs.mamba_pool)]
    pool = GrowableStatePool(reqs, GrowableStateBuffers(backend, kinds, 3, STATE_SLOTS + 1, 64))
    return cache, alloc, reqs, pool


def last_node(cache, tokens):
    return cache.match_prefix(MatchPrefixParams(key=key(tokens))).last_device_node  # a node id


def slot_of(cache, tokens):
    node = radix_tree.tree_core_of(cache)._node_arena[last_node(cache, tokens)]
    return int(node.component_data[ComponentType.MAMBA].value[0])


def test_the_state_pool_grows_in_place_and_moves_cached_states_down_before_it_shrinks():
    from vamp_sglang.memory.backend_choice import select_backend
    from vamp_sglang.memory.kv_buffers import KVShrinkError

    backend = select_backend("host", "cpu", granularity_bytes=64 * 1024)
    cache, alloc, reqs, pool = laid_out_cache(backend)
    temporal = reqs.mamba_pool.mamba_cache.temporal
    pool.buffers.grow_to(20, [backend.create(64 * 1024) for _ in range(
        pool.buffers.pages_for(20) - pool.buffers.pages_for(STATE_SLOTS + 1))])
    pool.resize(19)
    assert (reqs.mamba_pool.size, reqs.mamba_allocator.size, reqs.mamba_allocator.available_size()) == (19, 19, 19)
    assert reqs.mamba_pool.mamba_cache.temporal is temporal and temporal.shape[1] == 20
    held = reqs.mamba_allocator.alloc(17)  # the next state lands in the tail, at slot 18
    insert(cache, alloc, reqs, [7, 7, 7])
    reqs.mamba_allocator.free(held)
    tail = slot_of(cache, [7, 7, 7])
    assert tail == 18
    temporal[:, tail].fill_(2.5)
    with pytest.raises(KVShrinkError, match="not all free"):
        pool.resize(STATE_SLOTS)
    assert pool.tail_is_movable(cache, STATE_SLOTS)
    lock = cache.inc_lock_ref(last_node(cache, [7, 7, 7]))
    assert not pool.tail_is_movable(cache, STATE_SLOTS)  # a request may read a locked node's state
    cache.dec_lock_ref(last_node(cache, [7, 7, 7]), lock.to_dec_params())
    assert pool.compact(cache, STATE_SLOTS) == 1
    moved = slot_of(cache, [7, 7, 7])
    assert moved <= STATE_SLOTS and bool((temporal[:, moved] == 2.5).all())
    assert matched(cache, [7, 7, 7, 1]) == 3
    pool.resize(STATE_SLOTS)
    assert reqs.mamba_allocator.available_size() == STATE_SLOTS - 1 and temporal.shape[1] == STATE_SLOTS + 1
    for handle in pool.buffers.shrink_to(STATE_SLOTS + 1):
        backend.release(handle)
    pool.buffers.close()
    backend.close()
