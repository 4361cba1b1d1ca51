"""Leaves whose p_eff ties (a batch of requests finishing in one step writes them) cost a walk no more than others.

A walk yields a leaf once its key is below every bound not yet taken (cache/leaf_order.py). A bound that stops at
p_eff ties every leaf of one group last used at the same step, so the first of them came out only after all of
them were pulled: on `eval.bench_decision`'s tree, whose evicted turns are written back in one step, about 15 pulls
before the first candidate. These tests count the entries a walk pulls to yield the first few leaves, and check
that the walk is still the exact sort, also when the tree breaks ties by node id (the Rust core's mirror).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from vamp_sglang.cache import CostOrder, LeafOrder, NodeStats
from vamp_sglang.cache.reuse_share import CLASSES, writer_class
from vamp_sglang.integration.cache.radix_tree import _describe
from vamp_sglang.policy import Coefficients

WRITER, PRIOR = 0.9, 0.3


class _Node:
    """A leaf as LeafOrder sees one; ties between equal keys break by id, as the Rust core's mirror nodes do."""

    def __init__(self, node_id: int, stats: NodeStats, priority: int = 0) -> None:
        self.id, self.vamp_stats, self.priority = node_id, stats, priority

    def __lt__(self, other: "_Node") -> bool:
        return self.id < other.id


def _counted(ties_by_id: bool, leaves: list[_Node], now: int):
    """The leaves filed in a LeafOrder, a walk at `now`, and the count of entries it pulled (each pulled leaf is
    described once, to check that its statistics still match its filing)."""
    order_of = CostOrder(Coefficients())
    pulled = []

    def describe(node):
        pulled.append(node.id)
        return _describe(node)

    kept = LeafOrder(order_of.coefficients.alpha, order_of.coefficients.tau_steps, describe, ties_by_id=ties_by_id)
    for leaf in leaves:
        kept.add(leaf)
    priors = {writer_class(WRITER): PRIOR}

    def exact(node):  # the tree's key; where ties break by id, ending with it (LeafOrder's `ties_by_id`)
        key = (1, node.priority, *order_of.priority(node.vamp_stats, now, PRIOR))
        return (*key, node.id) if ties_by_id else key

    kept.prepare(now, priors, {})
    pulled.clear()
    return kept.walk(now, priors, {}, exact, lambda n: True), pulled, exact


def test_leaves_written_in_one_step_come_out_newest_first_without_pulling_them_all():
    """Same hits and last use, created at different steps (a prompt node and the turns before it, touched by one
    insert): the exact key's tail (-created, last) orders them, and the walk needs no more than the leaves it yields."""
    leaves = [_Node(i, NodeStats(500, 1, i, WRITER)) for i in range(200)]
    walk, pulled, _ = _counted(False, leaves, 5000)  # long past their reuse interval: by p_eff
    first = [next(walk).id for _ in range(5)]
    assert first == [199, 198, 197, 196, 195]
    assert len(pulled) <= 6, f"{len(pulled)} entries pulled to yield 5"


def test_on_the_mirror_leaves_tied_in_every_statistic_come_out_by_id_without_pulling_them_all():
    """Created and last used at the same step with the same hits (outputs of a batch finishing together): the Rust
    core's mirror breaks the tie by node id, which a bound can carry."""
    leaves = [_Node(i, NodeStats(500, 1, 400, WRITER)) for i in range(200)]
    walk, pulled, _ = _counted(True, leaves, 900)
    assert [next(walk).id for _ in range(5)] == [0, 1, 2, 3, 4]
    assert len(pulled) <= 6, f"{len(pulled)} entries pulled to yield 5"


def test_without_ids_in_the_bound_full_ties_still_come_out_in_the_trees_order():
    """SGLang's Python nodes break ties by their last access, which the order does not follow: every tied leaf is
    pulled, and the ready heap orders them by node."""
    leaves = [_Node(i, NodeStats(500, 1, 400, WRITER)) for i in range(30)]
    walk, _, _ = _counted(False, leaves, 900)
    assert [n.id for n in walk] == list(range(30))


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 8),
                          st.sampled_from([None, 0.0, 0.3, 0.9])), min_size=1, max_size=50),
       st.integers(0, 14), st.sampled_from([1.0, 2000.0, 1e20]), st.booleans())
@settings(max_examples=300, deadline=None)
def test_walks_over_many_ties_are_the_exact_sort(nodes, now, tau_steps, ties_by_id):
    """Few distinct steps, so many leaves tie in p_eff, in (p_eff, created) or in everything; some last used at or
    after the walk's step (age 0), and a tau so large that every age prices alike (no tail may then be trusted)."""
    order_of = CostOrder(Coefficients(tau_steps=tau_steps))
    kept = LeafOrder(order_of.coefficients.alpha, tau_steps, _describe, ties_by_id=ties_by_id)
    leaves = [_Node(i, NodeStats(created + age, hits, created, writer))
              for i, (hits, created, age, writer) in enumerate(nodes)]
    for leaf in leaves:
        kept.add(leaf)
    priors = {cls: 0.4 for cls in (None, *range(CLASSES))}

    def exact(node):
        key = (1, node.priority, *order_of.priority(node.vamp_stats, now, priors[writer_class(node.vamp_stats.prior)]))
        return (*key, node.id) if ties_by_id else key

    walk = kept.walk(now, priors, {}, exact, lambda n: True)
    assert [n.id for n in walk] == [n.id for n in sorted(leaves, key=lambda n: (exact(n), n))]
