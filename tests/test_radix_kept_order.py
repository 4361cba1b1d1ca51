"""The eviction order kept between shortfalls (cache/leaf_order.py) equals a full re-sort, always.

Random operation sequences on SGLang's real cache over our tree core (tests/test_radix_tree_state.py's
machine: requests, admissions, locks, unlocks, evictions, time passing), plus writers with known hit
rates, request priorities and admissions that move the tree-wide rate (and so the writer classes' priors). After every step the order
the kept structure gives must be the one a heap over every evictable leaf gives (SGLang's own walk,
`cache.walk.eviction_order`), and every eviction must take exactly the nodes the full re-sort predicts.
"""

import gc
import random
import weakref

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

from tests.test_radix_tree_state import POOL_TOKENS, RadixMachine, build_cache, key_of, sglang_context  # noqa: F401
from vamp_sglang.cache import CostOrder, LeafOrder, NodeStats, estimate, eviction_order
from vamp_sglang.cache.reuse_share import CLASSES, writer_class
from vamp_sglang.integration.cache import radix_eviction
from vamp_sglang.integration.cache.radix_tree import _describe
from vamp_sglang.policy import Coefficients


def full_resort(core):
    return list(eviction_order(radix_eviction._DeviceTreeView(core)))


class KeptOrderMachine(RadixMachine):
    def __init__(self) -> None:
        super().__init__()
        assert self.core.vamp_leaf_order is not None

    @rule(data=st.data(), prior=st.sampled_from([None, 0.0, 0.1, 0.5, 0.93, 1.0]), priority=st.integers(0, 2))
    def write_with_prior_and_priority(self, data, prior, priority):
        tokens = data.draw(self.sequences())
        match = self._match(tokens)
        prefix_len = match.device_prefix_len
        prefix = self.cache.path_device_indices(match.last_device_node)[:prefix_len]
        lock = self.cache.lock(match.last_device_node)  # or the allocation's eviction may free the prefix
        new = self._alloc(len(tokens) - prefix_len)
        if new is not None:
            with self.core.written_by(prior):
                self.cache.insert(InsertParams(key=key_of(tokens), value=torch.cat([prefix, new]),
                                               prev_prefix_len=prefix_len, priority=priority))
        self.cache.unlock(lock)

    @rule(hit=st.integers(0, 8))
    def tree_wide_rate_moves(self, hit):
        self.core.vamp_ledger.record(hit, 8)

    @rule(n_tokens=st.integers(0, POOL_TOKENS))
    def evict(self, n_tokens):
        view = radix_eviction._DeviceTreeView(self.core)
        predicted = estimate(view, n_tokens, lambda node: 0.0)  # a heap over every leaf
        before = {n.id for n in self.core.device_nodes()}
        self.cache.evict(EvictParams(num_tokens=n_tokens))
        assert before - {n.id for n in self.core.device_nodes()} == {n.id for n in predicted.nodes}

    @invariant()
    def kept_order_is_the_full_resort(self):
        assert [n.id for n in radix_eviction.kept_order(self.core)] == [n.id for n in full_resort(self.core)]

    @invariant()
    def kept_leaves_are_sglang_leaves(self):
        assert set(self.core.vamp_leaf_order.entries) == {n.id for n in self.core.evictable_device_leaves}


TestKeptOrder = KeptOrderMachine.TestCase
TestKeptOrder.settings = settings(max_examples=10, stateful_step_count=25, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_other_policies_keep_sglangs_heap():
    cache, _ = build_cache(1, False, "lru")
    assert cache.tree_core.vamp_leaf_order is None


class _Node:
    """A leaf as LeafOrder sees one: an id, SGLang's request priority, VAMP's stats."""

    def __init__(self, node_id: int, stats: NodeStats, priority: int) -> None:
        self.id, self.vamp_stats, self.priority = node_id, stats, priority

    def __lt__(self, other: "_Node") -> bool:
        return self.id < other.id


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.integers(0, 3000),
                          st.sampled_from([None, 0.0, 0.05, 0.3, 0.5, 0.51, 0.9, 1.0]), st.integers(0, 1)),
                min_size=1, max_size=60),
       st.lists(st.tuples(st.integers(0, 59), st.sampled_from(["hit", "touch", "drop", "priority", "rate", "walk"]),
                          st.integers(0, 5000)), max_size=40),
       st.integers(0, 8000))
@settings(max_examples=150, deadline=None)
def test_walk_order_is_the_sort_by_exact_key(nodes, ops, now):
    """Many leaves, statistics that grow, leaves that leave, time (deadlines of expected-back leaves passing)
    and the writer classes' priors and reuse intervals moving, also between walks (a walk reads the priors of
    its step for groups it did not re-file)."""
    order_of = CostOrder(Coefficients())
    priors = {cls: 0.4 for cls in (None, *range(CLASSES))}
    gaps = {}

    def exact(node):
        stats = node.vamp_stats
        cls = writer_class(stats.prior)
        return (1, node.priority, *order_of.priority(stats, now_step[0], priors[cls], gaps.get(cls)))

    kept = LeafOrder(order_of.coefficients.alpha, order_of.coefficients.tau_steps, _describe)
    live, now_step = {}, [0]
    for i, (hits, created, age, prior, priority) in enumerate(nodes):
        live[i] = _Node(i, NodeStats(created + age, hits, created, prior), priority)
        kept.add(live[i])

    def walk_is_the_sort(step):
        now_step[0] = step
        walk = kept.walk(step, dict(priors), dict(gaps), exact, lambda n: True)
        for node in live.values():  # a walk takes a filed leaf at its filing's key without pricing it
            key, entry, described, _ = kept.entries[node.id]
            if described == _describe(node):
                assert kept.filed_key(key, kept.bound(key, entry, step), entry) == exact(node)
        assert [n.id for n in walk] == [n.id for n in sorted(live.values(), key=lambda n: (exact(n), n))]

    for target, op, amount in ops:
        node = live.get(target)
        if op == "walk":
            walk_is_the_sort(now_step[0] + amount % 300)
            continue
        if op == "rate":  # one class's published prior and reuse interval move
            cls = [None, *range(CLASSES)][amount % (CLASSES + 1)]
            priors[cls] = (0.0, 0.02, 0.05, 0.1, 0.3, 0.35, 0.5, 0.9, 1.0)[amount % 9]  # below, at, above the floor
            if cls is not None and amount % 3 == 0:
                gaps[cls] = float(amount % 1700)
            elif amount % 3 == 1:
                gaps.pop(cls, None)  # the interval alone stays where it was otherwise
            continue
        if node is None:
            continue
        if op == "drop":
            kept.discard(live.pop(target))
            continue
        elif op == "hit":
            node.vamp_stats.admit(node.vamp_stats.last_step + amount % 7, count_hit=True)
        elif op == "touch":
            node.vamp_stats.touch(node.vamp_stats.last_step + amount)
        else:
            node.priority += 1
        kept.add(node)  # the tree re-files a leaf whose statistics change (leaf_order's contract)
    for step in (now, now + 2500, now + 40000):
        walk_is_the_sort(max(step, now_step[0]))


def test_a_discarded_leaf_is_not_kept_alive_by_its_dead_heap_entry():
    """An evicted node must be freed when SGLang drops it, not later by the next walk popping its dead
    entry (freeing a node frees its KV index tensor: measured at ~80 us, charged to the next decision)."""
    kept = LeafOrder(1.0, 2000.0, _describe)
    nodes = [_Node(i, NodeStats(i, 0, i, None), 0) for i in range(3)]
    for node in nodes:
        kept.add(node)
    kept.prepare(0, {}, {})  # filed in the heaps
    gone = weakref.ref(nodes[0])
    kept.discard(nodes.pop(0))
    gc.collect()
    assert gone() is None
    # never hit, class not published: p_eff 0 for both, so the newest goes first
    assert [n.id for n in kept.walk(10, {}, {}, lambda n: (n.vamp_stats.last_step,), lambda n: True)] == [2, 1]


# a writer class and the prior published for it (r_hit = 0.84: just below a 2^(1/8) edge of the r_hit buckets
# this order used to keep, where a bound fell furthest below its leaf's p_eff)
WRITER, PRIOR = 0.9, 0.84


def test_a_walk_prices_few_leaves_beyond_those_it_yields():
    """Equally hit leaves of every age: the first ten out should not cost a pricing of a hundred. A walk
    prices every leaf whose bound falls below the one it yields, and a group's bound is its leaf's p_eff, so
    only leaves that tie the last one yielded are priced beyond it."""
    order_of = CostOrder(Coefficients())
    tau = order_of.coefficients.tau_steps
    leaves = [_Node(i, NodeStats(int(i * 4 * tau / 1000), 0, 0, WRITER), 0) for i in range(1000)]
    now, priced = int(4 * tau), []

    def exact(node):
        priced.append(node.id)
        return (1, node.priority, *order_of.priority(node.vamp_stats, now, PRIOR))

    kept = LeafOrder(order_of.coefficients.alpha, tau, _describe)
    for leaf in leaves:
        kept.add(leaf)
    walk = kept.walk(now, {writer_class(WRITER): PRIOR}, {}, exact, lambda n: True)
    first = [next(walk).id for _ in range(10)]
    assert first == list(range(10))  # the oldest first
    assert len(priced) <= 30, f"{len(priced)} leaves priced to yield 10"


def test_refiling_without_walks_keeps_the_heaps_bounded():
    """A tree that never falls short never walks, yet every touch re-files a leaf and leaves a dead heap
    entry behind: the heaps must not keep them all (they grew for good, and the first walk popped them all:
    0.3 s on the bench's 100,323-node tree)."""
    order_of = CostOrder(Coefficients())
    kept = LeafOrder(order_of.coefficients.alpha, order_of.coefficients.tau_steps, _describe)
    leaves = [_Node(i, NodeStats(i, i % 3, 0, None), 0) for i in range(50)]
    for step in range(1, 200):
        for leaf in leaves:
            leaf.vamp_stats.touch(leaf.vamp_stats.last_step + step)
            kept.add(leaf)
    held = sum(len(heap) for heap in kept.groups.values()) + len(kept.deferred)
    assert held <= 2 * len(leaves) + 64 + 1, f"{held} heap entries for {len(leaves)} leaves"
    assert len(kept.deadlines) <= 2 * len(leaves) + 64 + 1
    now = leaves[-1].vamp_stats.last_step

    def exact(node):
        return (1, node.priority, *order_of.priority(node.vamp_stats, now, 0.0))

    walk = kept.walk(now, {}, {}, exact, lambda n: True)
    assert [n.id for n in walk] == [n.id for n in sorted(leaves, key=lambda n: (exact(n), n))]


def test_leaves_filed_while_a_walk_is_open_join_the_next_walk():
    """A walk reads the heaps by position, so what is filed while one is open waits until it closes;
    closing (or running out) files it, and a walk left open only delays it to the next prepare."""
    order_of = CostOrder(Coefficients())
    kept = LeafOrder(order_of.coefficients.alpha, order_of.coefficients.tau_steps, _describe)
    leaves = [_Node(i, NodeStats(10 * i, i % 2, 0, None), 0) for i in range(6)]
    for leaf in leaves[:3]:
        kept.add(leaf)
    now = 100

    def exact(node):
        return (1, node.priority, *order_of.priority(node.vamp_stats, now, 0.0))

    def walk_ids():
        return [n.id for n in kept.walk(now, {}, {}, exact, lambda n: True)]

    first = kept.walk(now, {}, {}, exact, lambda n: True)
    next(first)
    kept.add(leaves[3])  # filed during the open walk
    assert kept.deferred and not any(e[2] == 3 for heap in kept.groups.values() for e in heap)
    first.close()
    assert not kept.deferred
    assert walk_ids() == [n.id for n in sorted(leaves[:4], key=lambda n: (exact(n), n))]
    leaked = kept.walk(now, {}, {}, exact, lambda n: True)
    next(leaked)  # never closed
    kept.add(leaves[4])
    assert walk_ids() == [n.id for n in sorted(leaves[:5], key=lambda n: (exact(n), n))]



def test_a_class_prior_moving_refiles_no_leaf_whose_place_it_leaves_alone():
    """A writer class's published prior moves (one 2^(1/8) step) at a decision: leaves that were hit are not
    re-filed (their r_hit moves, but the walk reads a group's prior when it runs), nor never-hit ones whose
    mode stays (p_eff, not expected back). Re-filing all of them cost ~6 us per leaf at that decision
    (15 ms on `eval.bench_decision`'s 100,323-node tree, whose leaves were filed before any prior was
    published). The order must still be the exact sort."""
    order_of = CostOrder(Coefficients())
    kept = LeafOrder(order_of.coefficients.alpha, order_of.coefficients.tau_steps, _describe)
    refiled = []
    place = kept.place
    kept.place = lambda node, force=False: refiled.append(node.id) or place(node, force)
    leaves = [_Node(i, NodeStats(3 * i, i % 4, 0, 0.3 if i % 2 else 0.9), 0) for i in range(400)]
    for leaf in leaves:
        kept.add(leaf)
    now, classes = 5000, (None, *range(CLASSES))
    kept.prepare(now, {}, {})  # the hit leaves' own deadlines pass: they leave the expected-back heaps
    for step, priors in enumerate(({cls: 0.05 for cls in classes},  # no class reused enough to be expected back
                                   {cls: 0.05 * 2 ** (k / 8) for k, cls in enumerate(classes)},
                                   {cls: 0.07 for cls in classes})):

        def exact(node, priors=priors):
            stats = node.vamp_stats
            return (1, node.priority, *order_of.priority(stats, now, priors[writer_class(stats.prior)]))

        refiled.clear()
        walk = kept.walk(now, priors, {}, exact, lambda n: True)  # the first: priors published after the filing
        assert not refiled, f"walk {step}: {len(refiled)} of {len(leaves)} leaves re-filed for a prior that moved"
        assert [n.id for n in walk] == [n.id for n in sorted(leaves, key=lambda n: (exact(n), n))]


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 400), st.sampled_from([0.3, 0.9])), min_size=1, max_size=40),
       st.lists(st.tuples(st.sampled_from([0.0, 0.05, 0.1, 0.4, 0.45, 1.0]),
                          st.sampled_from([None, 1.0, 40.0, 45.0, 200.0]), st.integers(0, 120)), min_size=1, max_size=8))
@example(nodes=[(0, 100, 0.9), (0, 200, 0.9), (0, 300, 0.9), (0, 390, 0.9)],
         moves=[(0.4, 200.0, 0), (0.4, 40.0, 50)])  # the interval shrinks: deadlines come sooner than filed
@settings(max_examples=200, deadline=None)
def test_the_order_follows_class_priors_and_intervals_moving_between_walks(nodes, moves):
    """One class's prior and interval move between walks, across and within the modes its never-hit leaves are
    filed by (prior 0, p_eff, expected back after an interval): each walk is the exact sort at its step."""
    order_of = CostOrder(Coefficients())
    kept = LeafOrder(order_of.coefficients.alpha, order_of.coefficients.tau_steps, _describe)
    leaves = [_Node(i, NodeStats(created, hits, max(created - 50 * hits, 0), writer), 0)
              for i, (hits, created, writer) in enumerate(nodes)]
    for leaf in leaves:
        kept.add(leaf)
    now, classes = 400, (None, *range(CLASSES))
    priors = {cls: 0.4 for cls in classes}
    for prior, gap, elapsed in moves:
        now += elapsed
        priors[writer_class(0.9)] = prior
        gaps = {} if gap is None else {writer_class(0.9): gap}

        def exact(node, now=now, gaps=gaps):
            cls = writer_class(node.vamp_stats.prior)
            return (1, node.priority, *order_of.priority(node.vamp_stats, now, priors[cls], gaps.get(cls)))

        walk = kept.walk(now, dict(priors), gaps, exact, lambda n: True)
        assert [n.id for n in walk] == [n.id for n in sorted(leaves, key=lambda n: (exact(n), n))]


def _touch_order(n_leaves: int):
    """Never-hit leaves of ages 0..n-1 at step 1,000 (the oldest goes first), and their exact key then."""
    order_of = CostOrder(Coefficients())
    kept = LeafOrder(order_of.coefficients.alpha, order_of.coefficients.tau_steps, _describe)
    leaves = [_Node(i, NodeStats(10 * i, 0, 0, None), 0) for i in range(n_leaves)]
    for leaf in random.Random(0).sample(leaves, n_leaves):  # heap positions are not the order
        kept.add(leaf)
    priors = {None: 0.3}

    def exact(node):
        return (1, node.priority, *order_of.priority(node.vamp_stats, 1000, 0.3))

    return kept, leaves, priors, exact


def test_a_leaf_refiled_while_a_planner_walk_is_open_is_not_lost_to_it():
    """A read-only walk left open while a leaf is re-filed (its old entry dead, its new one deferred until the
    walk closes) must still yield that leaf, at its new key."""
    kept, leaves, priors, exact = _touch_order(8)
    walk = kept.walk(1000, priors, {}, exact, lambda n: True)
    first = next(walk)
    leaves[3].vamp_stats.touch(995)  # the fourth oldest becomes the second newest
    kept.add(leaves[3])
    rest = [n.id for n in walk]
    assert [first.id, *rest] == [0, *[n.id for n in sorted(leaves[1:], key=lambda n: (exact(n), n))]]


def test_a_walk_paused_while_another_runs_keeps_its_order():
    """A walk paused while leaves are re-filed and a second walk runs (whose prepare files the deferred entries,
    moving heap positions the first walk reads by) must go on in the exact order, each leaf once."""
    kept, leaves, priors, exact = _touch_order(40)
    first = kept.walk(1000, priors, {}, exact, lambda n: True)
    taken = [next(first).id for _ in range(3)]
    for i in (0, 5, 9, 17, 30) * 30:  # re-filed while the first walk is open, so often that the heaps are rebuilt
        leaves[i].vamp_stats.touch(leaves[i].vamp_stats.last_step + 1)
        kept.add(leaves[i])
    second = [n.id for n in kept.walk(1000, priors, {}, exact, lambda n: True)]
    assert second == [n.id for n in sorted(leaves, key=lambda n: (exact(n), n))]
    rest = [n.id for n in first]
    assert rest == [i for i in second if i not in taken]


def test_dead_counts_the_dead_entries_in_the_heaps():
    """`dead` decides when the heaps are rebuilt: re-filing one leaf many times while a walk is open leaves one
    dead entry in a heap (the others never reached one), not one per re-filing twice over."""
    kept, leaves, priors, exact = _touch_order(5)
    walk = kept.walk(1000, priors, {}, exact, lambda n: True)
    next(walk)
    for step in range(1, 11):
        leaves[0].vamp_stats.touch(step)
        kept.add(leaves[0])
    walk.close()  # it also drops the dead entries at the heaps' tops (`drop_dead_tops`)
    held = sum(len(heap) for heap in kept.groups.values())
    assert kept.dead == held - len(kept.entries) <= 1


def test_a_leaf_refused_at_its_turn_and_filed_again_is_not_lost_to_the_walk():
    """A leaf waiting in an open walk, refused when its turn came (locked then), is unlocked again before the walk
    ends: it must still come out (found by an adversarial read: it stayed `seen`, so the re-filing was ignored)."""
    kept, leaves, priors, exact = _touch_order(4)
    live = {leaf.id for leaf in leaves}
    walk = kept.walk(1000, priors, {}, exact, lambda n: n.id in live)
    assert next(walk).id == 0
    leaves[3].vamp_stats.last_step = 1  # re-dated the oldest: it joins the walk's ready heap at the front
    kept.add(leaves[3])
    kept.discard(leaves[3])
    live.discard(3)  # locked before its turn
    assert next(walk).id == 1  # its turn came and went: refused
    live.add(3)
    kept.add(leaves[3])  # unlocked
    assert sorted(n.id for n in walk) == [2, 3]
