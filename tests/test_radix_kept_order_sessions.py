"""The kept eviction order under SGLang's radix-native sessions (`--enable-session-radix-cache`) equals SGLang's.

SGLang's key is then (held by an open session, by how many, the tree's priority): the kept order ranks its groups
by that head (cache/leaf_order.py), re-files leaves when a session's coverage moves, and the read-only predictions
replay how each eviction moves a session's references (integration/cache/session_refs.py). Sessions tag KV and close
through SGLang's own tracker (`eval.cachesim.tree.tag_session`).
"""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from eval.cachesim.tree import tag_session
from tests.test_radix_kept_order import KeptOrderMachine, full_resort
from tests.test_radix_tree_state import build_cache, key_of, sglang_context  # noqa: F401
from vamp_sglang.integration.cache import radix_eviction


class KeptOrderSessionsMachine(KeptOrderMachine):
    """With SGLang's radix-native sessions: KV of no open session first, then fewer open sessions first, then
    VAMP's order (FullComponent's key); sessions tag what requests leave and close, through SGLang's tracker."""

    sessions = True

    @rule(data=st.data(), session=st.sampled_from("abc"))
    def tag_with_session(self, data, session):
        """A finished request of `session`: its KV, matched here, is registered as cache_finished_req does."""
        match = self._match(data.draw(self.sequences()))
        if match.device_prefix_len:
            tag_session(self.cache, session, match.last_device_node)

    @rule(session=st.sampled_from("abc"))
    def close_session(self, session):
        self.cache.release_radix_session(session)


TestKeptOrderSessions = KeptOrderSessionsMachine.TestCase
# a directed test below covers the re-filing when a session closes; this machine, the mix of everything
TestKeptOrderSessions.settings = settings(max_examples=30, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])



@pytest.mark.parametrize("host_copies, expected", [
    (False, [[1, 1], [2, 2], [0, 0, 0, 0], [3, 3]]),  # the parent holds one reference then, at priority 0
    (True, [[1, 1], [2, 2], [3, 3], [0, 0, 0, 0]]),  # HiCache demotes, not deletes: the parent keeps both
])
def test_the_predicted_order_reads_session_refs_as_the_eviction_leaves_them(host_copies, expected):
    """A session tags two sibling branches (a regenerated answer). When the first goes, the shared parent becomes
    the session's frontier; when the second goes, SGLang recedes the session's reference from the parent too. The
    read-only predictions (the kept order's walk and the heap over every leaf) must price the parent with the
    reference it has then, not the one it has now, or they put another session's KV first. A leaf with a host
    copy (HiCache, faked as tests/test_radix_refile_paths.py does) is demoted instead and moves no reference."""
    cache, allocator = build_cache(1, True, "vamp")
    core = cache.tree_core

    def write(tokens, session, priority=0):
        match = cache.match_prefix(MatchPrefixParams(key=key_of(tokens)))
        prefix = cache.path_device_indices(match.last_device_node)[:match.device_prefix_len]
        new = allocator.alloc(len(tokens) - match.device_prefix_len)
        result = cache.insert(InsertParams(key=key_of(tokens), value=torch.cat([prefix, new]),
                                           prev_prefix_len=match.device_prefix_len, priority=priority))
        tag_session(cache, session, result.last_device_node)

    write([0, 0, 0, 0, 1, 1], "s")
    write([0, 0, 0, 0, 2, 2], "s")  # the same turn again: a sibling branch of one session
    write([3, 3], "t", priority=1)  # another open session's KV, a higher request priority
    for node in core.device_nodes() if host_copies else ():
        node.component_data[ComponentType.FULL].host_value = torch.arange(1000, 1000 + len(node.key))
    predicted = [list(n.key) for n in radix_eviction.kept_order(core)]
    resorted = [list(n.key) for n in full_resort(core)]
    actual = []
    while core.evictable_device_leaves:
        before = {n.id: list(n.key) for n in core.device_nodes()}
        cache.evict(EvictParams(num_tokens=1))
        actual += [key for node_id, key in before.items() if node_id not in {n.id for n in core.device_nodes()}]
    assert actual == expected
    assert predicted == actual
    assert resorted == actual


def test_a_closed_session_s_leaf_moves_to_the_front_of_the_kept_order():
    """Closing a session lowers its leaf's rank; a filing left at the old rank would be reached too late."""
    cache, allocator = build_cache(1, True, "vamp")
    core = cache.tree_core
    for session, tokens, priority in (("a", [0, 0, 1], 0), ("b", [2, 2, 1], 1)):  # b's higher priority: a goes first
        value = allocator.alloc(len(tokens))
        result = cache.insert(InsertParams(key=key_of(tokens), value=value, priority=priority))
        tag_session(cache, session, result.last_device_node)
    a, b = radix_eviction.kept_order(core)
    assert (a.priority, b.priority) == (0, 1)
    cache.release_radix_session("b")  # held by no open session now: before every leaf that is
    assert [n.id for n in radix_eviction.kept_order(core)] == [b.id, a.id]
    assert [n.id for n in full_resort(core)] == [b.id, a.id]
