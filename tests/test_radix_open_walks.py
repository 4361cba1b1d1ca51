"""The kept eviction order's walks while the tree changes under them (cache/leaf_order.py,
integration/cache/radix_eviction.py): the live eviction walk, planner walks stopped early, paused or leaked, and
leaves re-filed while a walk is open. Split from tests/test_radix_refile_paths.py, whose helpers it uses."""

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from tests.test_radix_kept_order import _Node
from tests.test_radix_refile_paths import _FreshView, _Tree
from tests.test_radix_tree_state import sglang_context  # noqa: F401
from vamp_sglang.cache import CostOrder, LeafOrder, NodeStats, estimate
from vamp_sglang.cache.reuse_share import CLASSES, writer_class
from vamp_sglang.integration.cache import radix_eviction
from vamp_sglang.integration.cache.radix_tree import _describe
from vamp_sglang.policy import Coefficients


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


def test_a_walk_left_open_past_its_step_prices_what_a_later_walk_refiled():
    """Walk A opens at step 200 and pauses; walk B runs at step 300 and moves a leaf whose expected-back deadline
    (250) fell between them to the p_eff groups. A, which the tree prices at its own step, must still take that
    leaf as expected back (found by an adversarial review: A took it at B's filing, too early)."""
    c = CostOrder(Coefficients())
    priors = {cls: 0.0 for cls in (None, *range(CLASSES))}
    leaves = [_Node(0, NodeStats(100, 1, 0, None), 0),  # hit once, interval 100: expected back until 250
              _Node(1, NodeStats(40, 4, 0, None), 0),  # its deadline (55) long past: by p_eff
              _Node(2, NodeStats(10, 0, 0, 0.9), 0)]  # never hit, class prior 0: first
    kept = LeafOrder(c.coefficients.alpha, c.coefficients.tau_steps, _describe)
    for leaf in leaves:
        kept.add(leaf)

    def exact_at(step):
        return lambda n: (1, n.priority, *c.priority(n.vamp_stats, step, priors[writer_class(n.vamp_stats.prior)]))

    first = kept.walk(200, dict(priors), {}, exact_at(200), lambda n: True)
    got = [next(first).id]
    list(kept.walk(300, dict(priors), {}, exact_at(300), lambda n: True))
    got += [n.id for n in first]
    assert got == [n.id for n in sorted(leaves, key=lambda n: (exact_at(200)(n), n))] == [2, 1, 0]
