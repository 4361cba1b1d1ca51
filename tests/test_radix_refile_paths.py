"""The kept eviction order on its re-file paths (cache/leaf_order.py, integration/cache/radix_tree.py), from an adversarial read.

Every check compares the kept order with a heap over every evictable leaf keyed by the tree's exact
priority, computed afresh (not through the tree's per-step memo, which both the kept order and
`vamp_priority` read, so a stale memo would hide from a comparison of the two)."""

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

from tests.test_radix_kept_order import KeptOrderMachine, full_resort
from tests.test_radix_tree_state import POOL_TOKENS, build_cache, key_of, sglang_context  # noqa: F401
from vamp_sglang.cache import eviction_order
from vamp_sglang.integration.cache import radix_backend, radix_eviction, radix_tree


def fresh_priority(core):
    """The tree's exact key, computed from the node and the published priors now (no memo)."""
    now, shares = core.now_steps(), core.vamp_shares
    shares.refresh(core.vamp_ledger.hit_rate)

    def priority(node):
        stats = node.vamp_stats
        return (1, node.priority, *core.vamp_order.priority(stats, now, shares.prior(stats.prior),
                                                           shares.gap_steps(stats.prior)))
    return priority


class _FreshView(radix_eviction._DeviceTreeView):
    def __init__(self, core):
        super().__init__(core)
        self.priority = fresh_priority(core)


def fresh_resort(core):
    return [n.id for n in eviction_order(_FreshView(core))]


def kept_ids(core):
    return [n.id for n in radix_eviction.kept_order(core)]


class RefileMachine(KeptOrderMachine):
    """KeptOrderMachine plus the re-file paths: unlocked re-inserts that raise a leaf's request priority,
    leaked walks, planner walks stopped early, many re-filings (heap rebuilds) and first hits that move a
    class's published interval."""

    def __init__(self) -> None:
        super().__init__()
        self.leaked = []

    @rule(data=st.data(), priority=st.integers(0, 3), prior=st.sampled_from([None, 0.0, 0.6, 0.9]))
    def reinsert_unlocked_with_priority(self, data, priority, prior):
        """A recomputed prefix inserted again (no lock): the insert walk touches each node, then raises
        its priority; the leaf it ends in is re-filed at the touch, before the raise."""
        tokens = data.draw(self.sequences())
        value = self._alloc(len(tokens))
        if value is not None:
            with self.core.written_by(prior):
                self.cache.insert(InsertParams(key=key_of(tokens), value=value, priority=priority))

    @rule(hit=st.integers(0, 3))
    def tree_rate_stays_low(self, hit):
        """Tree-wide rates below 0.1: small priors, small r_hit, still expected back where an interval is known."""
        self.core.vamp_ledger.record(hit, 40)

    @rule(k=st.integers(0, 4))
    def leak_a_walk(self, k):
        walk = self.core.vamp_ordered_walk(lambda n: True)
        for _ in range(k):
            if next(walk, None) is None:
                break
        self.leaked.append(walk)

    @precondition(lambda self: self.leaked)
    @rule()
    def close_a_leaked_walk(self):
        self.leaked.pop(0).close()

    @rule(need=st.integers(1, POOL_TOKENS))
    def planner_stops_early(self, need):
        out = radix_eviction.eviction_candidates(self.cache, need, 0, 1, 0)
        order = [n for n in full_resort(self.core)]
        assert [b.tokens for b in out] == [self.core.node_tokens(n) for n in order[:len(out)]]

    @rule(data=st.data(), steps=st.integers(0, 50))
    def admit_then_refile(self, data, steps):
        """Admission under a lock, time passing, unlock: the leaf re-filed with its new hit."""
        self.step += steps
        match = self._match(data.draw(self.sequences()))
        lock = self.cache.lock(match.last_device_node)
        self.core.record_admission(match.last_device_node, match.device_prefix_len,
                                   max(match.device_prefix_len, 1), first=True)
        self.cache.unlock(lock)

    @invariant()
    def kept_order_is_the_fresh_resort(self):
        assert kept_ids(self.core) == fresh_resort(self.core)

    @invariant()
    def bounds_never_exceed_exact_keys(self):
        order, core = self.core.vamp_leaf_order, self.core
        if order.open_walks:
            return
        exact = fresh_priority(core)
        order.prepare(core.now_steps(), core.vamp_shares.published, core.vamp_shares.published_gaps)
        for key, entry, _, node in order.entries.values():
            assert order.bound(key, entry, core.now_steps()) <= exact(node), (node.id, key, entry)

    def teardown(self) -> None:
        for walk in self.leaked:
            walk.close()
        super().teardown()


TestRefile = RefileMachine.TestCase
TestRefile.settings = settings(max_examples=int(os.environ.get("REVIEW_EXAMPLES", "60")), stateful_step_count=40,
                               deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- targeted paths on the real cache -------------------------------------------------------------
class _Tree:
    """A CPU cache as tests/test_radix_tree_state.py builds it, with a step counter."""

    def __init__(self):
        self.cache, self.allocator = build_cache(1)
        self.core = radix_tree.tree_core_of(self.cache)
        assert self.core.vamp_leaf_order is not None
        self.step = 0
        radix_backend.bind_step_source(self.cache, lambda: self.step)

    def insert(self, tokens, priority=0, prior=None):
        value = self.allocator.alloc(len(tokens))
        with self.core.written_by(prior):
            self.cache.insert(InsertParams(key=key_of(tokens), value=value, priority=priority))

    def leaf(self, tokens):
        match = self.cache.match_prefix(MatchPrefixParams(key=key_of(tokens)))
        return self.core.node_by_id(match.last_device_node)

    def check(self):
        assert set(self.core.vamp_leaf_order.entries) == {n.id for n in self.core.evictable_device_leaves}
        assert kept_ids(self.core) == fresh_resort(self.core)


def test_raising_an_unlocked_leafs_priority_after_its_touch_keeps_the_order():
    """The insert walk touches a node (re-filing it) and only then raises its priority: the entry keeps
    the lower priority, a lower bound, and the walk re-files it when it meets it."""
    t = _Tree()
    t.insert([1, 1, 1])
    t.insert([2, 2, 2])
    t.step = 10
    t.check()
    t.insert([1, 1, 1], priority=5)  # ends on the existing leaf: no lock, no leaf-set update after the raise
    leaf = t.leaf([1, 1, 1])
    assert leaf.priority == 5
    assert t.core.vamp_leaf_order.entries[leaf.id][2][0] == 0  # filed with the old priority
    t.check()
    assert kept_ids(t.core)[-1] == leaf.id  # the higher priority goes last
    assert t.core.vamp_leaf_order.entries[leaf.id][2][0] == 5  # the walk re-filed it
    t.check()


def test_lock_unlock_refiles_an_admitted_leaf():
    t = _Tree()
    for tok in range(4):
        t.insert([tok] * 3)
    t.step = 100
    leaf = t.leaf([2, 2, 2])
    lock = t.cache.lock(leaf.id)
    assert leaf.id not in t.core.vamp_leaf_order.entries
    t.core.record_admission(leaf.id, 3, 3, first=True)
    t.step = 101
    t.check()  # the locked leaf is not a candidate
    t.cache.unlock(lock)
    assert t.core.vamp_leaf_order.entries[leaf.id][2][1] == 1  # re-filed with its hit
    t.check()
    assert kept_ids(t.core)[-1] == leaf.id


def test_heap_rebuild_between_walks_keeps_the_order():
    t = _Tree()
    for tok in range(5):
        t.insert([tok] * 3, prior=[None, 0.1, 0.6, 0.9, 1.0][tok])
    order = t.core.vamp_leaf_order
    rebuilt = 0
    for step in range(1, 300):
        t.step = step * 3
        dead = order.dead
        t.insert([step % 5] * 3)
        rebuilt += order.dead < dead
        if step % 100 == 0:
            t.check()
    assert rebuilt
    t.check()


def test_a_class_prior_and_interval_moving_between_walks_refile_its_nodes():
    t = _Tree()
    for tok in range(4):
        t.insert([tok] * 4, prior=0.9)
    for tok in range(4, 8):
        t.insert([tok] * 4, prior=0.1)
    t.step = 50
    t.check()
    version = t.core.vamp_shares.refresh(t.core.vamp_ledger.hit_rate)
    leaf = t.leaf([0, 0, 0, 0])
    lock = t.cache.lock(leaf.id)
    t.core.record_admission(leaf.id, 4, 5, first=True)  # a first hit: the 0.9 class gets a reuse interval
    t.cache.unlock(lock)
    t.core.vamp_ledger.record(60, 64)
    assert t.core.vamp_shares.refresh(t.core.vamp_ledger.hit_rate) != version
    for step in (50, 60, 120, 4000):
        t.step = step
        t.check()


def test_hicache_unevict_on_insert_refiles_the_restored_leaf():
    """HiCache's `_unevict_node_on_insert`, reached on the CPU cache by giving a leaf a (fake) host copy: the
    eviction demotes it (its parent becomes a leaf mid-walk), an insert restores it with a higher priority;
    the restored leaf must be filed with its touch and priority, and its parent dropped."""
    from tests.test_radix_tree_state import FULL
    t = _Tree()
    t.insert([1, 1, 1, 1])
    t.insert([1, 1, 1, 1, 2, 2])
    t.insert([3, 3])
    t.step = 10
    t.insert([4, 4])
    leaf = t.leaf([1, 1, 1, 1, 2, 2])
    parent = leaf.parent
    leaf.component_data[FULL].host_value = torch.arange(100, 102)
    t.step = 5000
    t.cache.evict(EvictParams(num_tokens=6))
    assert leaf.evicted and leaf.backuped
    assert {n.id for n in t.core.evictable_device_leaves} == {parent.id}
    t.check()
    t.step = 6000
    t.cache.insert(InsertParams(key=key_of([1, 1, 1, 1, 2, 2]), value=t.allocator.alloc(6), priority=3))
    assert not leaf.evicted and t.core.vamp_restored_tokens == 2
    assert t.core.vamp_leaf_order.entries[leaf.id][2] == (3, 0, 6000, 0, None)
    assert parent.id not in t.core.vamp_leaf_order.entries
    t.check()
    assert kept_ids(t.core) == [leaf.id, parent.id]


class PagedRefileMachine(RefileMachine):
    page_size = 4


TestRefilePaged = PagedRefileMachine.TestCase
TestRefilePaged.settings = TestRefile.settings
