"""The kept eviction order on its re-file paths (cache/leaf_order.py, integration/radix_tree.py), from an adversarial read.

Every check compares the kept order with a heap over every evictable leaf keyed by the tree's exact
priority, computed afresh (not through the tree's per-step memo, which both the kept order and
`vamp_priority` read, so a stale memo would hide from a comparison of the two)."""

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

from tests.test_radix_kept_order import KeptOrderMachine, _Node, full_resort
from tests.test_radix_tree_state import POOL_TOKENS, build_cache, key_of, sglang_context  # noqa: F401
from vamp_sglang.cache import CostOrder, LeafOrder, NodeStats, estimate, eviction_order
from vamp_sglang.cache.reuse_share import writer_class
from vamp_sglang.integration import radix_backend, radix_eviction, radix_tree
from vamp_sglang.integration.radix_tree import _describe
from vamp_sglang.policy import Coefficients


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


def test_the_live_eviction_walk_takes_parents_freed_by_its_own_evictions():
    """evict() runs the kept order live: evicting a leaf makes its parent a leaf mid-walk, which must join
    at its exact key, exactly where SGLang's heap would put it."""
    t = _Tree()
    t.insert([5, 5, 5, 5])
    t.insert([5, 5, 5, 5, 6, 6])  # child of [5,5,5,5]
    t.insert([7, 7])
    t.step = 3000
    t.insert([8, 8])
    t.step = 6000
    parent = t.leaf([5, 5, 5, 5])  # (a match re-stamps SGLang's tie-break, so before the prediction)
    predicted = estimate(_FreshView(t.core), 8, lambda node: 0.0)  # SGLang's heap, fresh keys
    assert parent in predicted.nodes  # the parent, freed by its child's eviction
    before = {n.id for n in t.core.device_nodes()}
    t.cache.evict(EvictParams(num_tokens=8))
    assert before - {n.id for n in t.core.device_nodes()} == {n.id for n in predicted.nodes}
    assert t.core.vamp_leaf_order.open_walks == 0
    assert not t.core.vamp_leaf_order.deferred
    t.check()


def test_a_planner_walk_stopped_early_is_closed():
    t = _Tree()
    for tok in range(6):
        t.insert([tok] * 2)
        t.step += 7
    out = radix_eviction.eviction_candidates(t.cache, 2, 0, 1, 0)
    assert len(out) == 1
    order = t.core.vamp_leaf_order
    assert order.open_walks == 0 and not order.deferred
    t.insert([9, 9])  # filed straight into the heaps
    assert not order.deferred
    t.check()


def test_a_leaked_walk_neither_loses_refilings_nor_lets_the_heaps_grow():
    t = _Tree()
    for tok in range(6):
        t.insert([tok] * 2)
    leaked = t.core.vamp_ordered_walk(lambda n: True)
    next(leaked)
    order = t.core.vamp_leaf_order
    for step in range(1, 400):  # every touch re-files a leaf while the leaked walk holds the heaps
        t.step = step
        t.insert([step % 6] * 2)
    assert len(order.deferred) >= 399
    t.check()  # the next walk files them
    assert not order.deferred
    held = sum(len(h) for h in order.groups.values())
    assert held <= 2 * len(order.entries) + 64 + 1
    leaked.close()
    assert order.open_walks == 0
    t.check()


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


def _kept(now_step, priors, gaps):
    order_of = CostOrder(Coefficients())

    def exact(node):
        stats = node.vamp_stats
        cls = writer_class(stats.prior)
        return (1, node.priority, *order_of.priority(stats, now_step[0], priors.get(cls, 0.0), gaps.get(cls)))
    return LeafOrder(order_of.coefficients.alpha, order_of.coefficients.tau_steps, _describe), exact


def test_a_leaf_refiled_during_the_live_walk_is_taken_at_its_new_key():
    """The live walk (evict) sees a re-filed leaf through `push`: a not yet yielded leaf whose stats grow
    mid-walk comes out at its new key, exactly once."""
    now = [5000]
    priors, gaps = {None: 0.5}, {}
    kept, exact = _kept(now, priors, gaps)
    leaves = {i: _Node(i, NodeStats(100 * i, 0, 0, None), 0) for i in range(6)}
    for leaf in leaves.values():
        kept.add(leaf)
    walk = kept.walk(now[0], priors, gaps, exact, lambda n: n.id in leaves)
    first = next(walk)
    assert first.id == 0
    del leaves[0]
    kept.discard(first)
    leaves[1].vamp_stats.touch(4999)  # the next in line is used again: now the newest
    kept.add(leaves[1])
    rest = [n.id for n in walk]
    assert rest == [n.id for n in sorted(leaves.values(), key=lambda n: (exact(n), n))]
    assert rest.count(1) == 1 and kept.open_walks == 0 and not kept.deferred


def test_a_deadline_passing_between_walks_moves_an_expected_leaf_to_the_front():
    """A never-hit leaf of a class with a published interval is expected back until 1.5 intervals pass;
    after that it must sort by p_eff again (before every expected-back leaf), at exactly the step the exact
    key switches, also when it was filed after the last walk (with that walk's stale `now`)."""
    now = [0]
    priors, gaps = {None: 0.5, 3: 0.5}, {3: 100.0}
    kept, exact = _kept(now, priors, gaps)
    a = _Node(1, NodeStats(1000, 0, 1000, 0.9), 0)  # expected until 1150
    b = _Node(2, NodeStats(1040, 0, 900, 0.9), 0)  # expected until 1190, next use 1140: after a's 1100
    kept.add(b)
    list(kept.walk(10, priors, gaps, exact, lambda n: True))  # a walk long before: now = 10
    kept.add(a)
    for step, want in ((1100, [2, 1]), (1150, [2, 1]), (1151, [1, 2]), (1190, [1, 2]), (1191, [1, 2]),
                       (9000, [1, 2])):
        now[0] = step
        got = [n.id for n in kept.walk(step, priors, gaps, exact, lambda n: True)]
        assert got == [n.id for n in sorted([a, b], key=lambda n: (exact(n), n))] == want, step


class PagedRefileMachine(RefileMachine):
    page_size = 4


TestRefilePaged = PagedRefileMachine.TestCase
TestRefilePaged.settings = TestRefile.settings


def test_a_walk_left_open_past_its_step_does_not_price_into_the_current_memo():
    """Leaves re-filed while a walk is open join it, priced at that walk's step. A walk left open (leaked) from
    an earlier step must not write those old-step priorities into the memo a later step's walks read
    (found by RefileMachine: a leaked walk, a lock, a step, an unlock gave two leaves in the wrong order)."""
    t = _Tree()
    t.insert([1] * 3)
    t.insert([2] * 3)
    t.step = 10
    a = t.leaf([1] * 3)
    lock = t.cache.lock(a.id)
    t.core.record_admission(a.id, 3, 4, first=True)  # hit after 10 steps: expected back until step 25
    t.cache.unlock(lock)
    t.step = 20
    leaked = t.core.vamp_ordered_walk(lambda n: True)  # at step 20, never advanced nor closed
    lock = t.cache.lock(a.id)  # out of the leaf set
    t.step = 4990
    t.insert([3] * 3)  # never hit, its class's interval is 10 steps: expected back until 5005
    t.step = 5000
    t.check()  # a walk at step 5000: its memo holds step-5000 priorities
    t.cache.unlock(lock)  # `a` re-filed, and pushed to the leaked walk, which prices it at step 20 (expected back)
    t.check()  # at step 5000 `a` is overdue: it goes before the expected-back leaf
    leaked.close()


def test_a_paused_planner_walk_does_not_yield_a_leaf_locked_meanwhile():
    """Leaves re-filed while a planner walk is open join it; one locked after that is no longer a candidate."""
    t = _Tree()
    for tok in range(4):
        t.insert([tok] * 3)
        t.step += 10
    walk = radix_eviction.kept_order(t.core)
    first = next(walk)
    t.insert([0] * 3)  # the oldest leaf re-filed at step 40 (an insert walk touches it): it joins the walk
    target = t.leaf([0] * 3)
    lock = t.cache.lock(target.id)  # and locked while the walk is paused
    rest = [n.id for n in walk]
    assert target.id not in rest and first.id not in rest
    t.cache.unlock(lock)
    t.check()
