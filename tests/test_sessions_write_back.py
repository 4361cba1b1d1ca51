"""The kept eviction order under SGLang's radix-native sessions and HiCache's write-back policy.

A device eviction under write-back copies each victim to host first, and where the host pool is full SGLang
evicts host leaves right there, inside the device walk; deleting a session's frontier leaf moves that session's
references, so a device leaf's session-ref count can change while the walk is open (found by an adversarial
review of the session hooks). The test runs VAMP's kept order (`VampTreeCore._vamp_evict_*`) and SGLang's stock
FullComponent heap (the same tree core with the three replaced methods removed, so SGLang's session-ref key wraps
`VampStrategy`'s priority) through the same operations and compares the leaves each evicts, in order.
"""

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from eval.cachesim.tree import tag_session
from tests.test_radix_tree_state import build_cache, key_of, sglang_context  # noqa: F401

FULL = ComponentType.FULL


def _cache(stock: bool):
    cache, allocator = build_cache(1, True, "vamp")
    core = cache.tree_core
    assert core.vamp_sessions and core.vamp_leaf_order is not None
    if stock:  # SGLang's own heap over every leaf, keyed (ref > 0, ref, VampStrategy's priority)
        full = core.components_by_type[FULL]
        for name in ("_evict_device_start", "_evict_device_next_node", "_evict_device_end"):
            delattr(full, name)

    def write(tokens, priority=0):
        result = cache.insert(InsertParams(key=key_of(tokens), value=allocator.alloc(len(tokens)), priority=priority))
        return core.node_by_id(result.last_device_node)
    return cache, core, write


def _write_back_with_a_full_host_pool(cache, core):
    """HiCache's write-back policy (`is_write_back`), its D->H copy faked: `_execute_kv_backup` finds the host pool
    full and calls `evict_host` for the tokens it needs (unified_radix_cache.py, `_execute_kv_backup`), then writes
    the copy; the eviction loop (`_evict_components`) then demotes the victim. Only the copy's I/O is faked."""
    cache.is_write_back = True

    def backup(action, write_back=False):
        written = 0
        for node_id in action.node_ids:
            node = core.node_by_id(node_id)
            cache.evict_host(len(node.key))  # host pool full: SGLang's host eviction, inside the device walk
            node.component_data[FULL].host_value = torch.arange(9000, 9000 + len(node.key))
            written = len(node.key)
        return written
    cache._execute_and_commit_kv_backup = backup


def _evicted_in_order(cache, core, n_tokens):
    order, evict_leaf = [], core.evict_device_leaf

    def logged(node_id, is_write_back):
        order.append(list(core.node_by_id(node_id).key))
        return evict_leaf(node_id, is_write_back)
    core.evict_device_leaf = logged
    cache.evict(EvictParams(num_tokens=n_tokens))
    return order


def _regenerated_turn_under_write_back(stock: bool):
    """Session s: a turn ending at h = [1,1,2,2], then a regenerated turn ending at its parent p = [1,1] (two frontier
    leaves, p counted twice); h was demoted to host earlier. Session t holds y = [3,3] at a higher request priority;
    x = [5,5] is held by no session. Device leaves then: x (0 refs), y (1), p (2)."""
    cache, core, write = _cache(stock)
    x = write([5, 5])
    p = write([1, 1])
    h = write([1, 1, 2, 2])
    y = write([3, 3], priority=1)
    tag_session(cache, "s", h.id)
    tag_session(cache, "s", p.id)
    tag_session(cache, "t", y.id)
    h.component_data[FULL].host_value = torch.arange(100, 102)
    cache._apply_eviction_result(core.demote(h.id))
    full = core.components_by_type[FULL]
    assert [full.session_ref(n) for n in (x, p, y)] == [0, 2, 1]
    assert {n.id for n in core.evictable_device_leaves} == {x.id, p.id, y.id}
    _write_back_with_a_full_host_pool(cache, core)
    return cache, core


def test_a_host_eviction_inside_a_write_back_device_walk_keeps_sglangs_order():
    """Write-back: evicting x first writes its host copy; the host pool is full, so SGLang evicts the host leaf h
    right there, inside the device walk. h is a frontier leaf of s whose fallback p is one too, so
    `discard_deleted_session_leaf` recedes s to the root: p's session_ref drops 2 -> 1 mid-walk. SGLang's heap keeps
    p at the key it computed at `_evict_device_start` (ref 2) and takes y (ref 1) next. VAMP's walk must too: re-filing
    p into the open walk at ref 1, where its lower request priority puts it before y, took p first."""
    stock_cache, stock_core = _regenerated_turn_under_write_back(stock=True)
    vamp_cache, vamp_core = _regenerated_turn_under_write_back(stock=False)
    stock = _evicted_in_order(stock_cache, stock_core, 6)
    vamp = _evicted_in_order(vamp_cache, vamp_core, 6)
    assert stock == [[5, 5], [3, 3], [1, 1]]
    assert vamp == stock
