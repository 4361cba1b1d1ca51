"""The read-only eviction walk against a brute-force eviction of a toy tree (pure Python)."""

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vamp_sglang.cache import estimate, eviction_order


@dataclass
class ToyTree:
    """Node 0 is the root; a lock pins the node and its ancestors, like SGLang's lock_ref."""

    parent: list[int]
    tokens_of: list[int]
    priority_of: list[float]
    locked: set[int] = field(default_factory=set)

    def children(self, node: int) -> list[int]:
        return [n for n, p in enumerate(self.parent) if n and p == node]

    def is_leaf(self, node: int, removed: set[int]) -> bool:
        return (node != 0 and node not in removed and node not in self.locked
                and all(c in removed for c in self.children(node)))

    # --- EvictableTree ---
    def evictable_leaves(self):
        return [n for n in range(len(self.parent)) if self.is_leaf(n, set())]

    def priority(self, node):
        return self.priority_of[node]

    def tokens(self, node):
        return self.tokens_of[node]

    def parent_if_leaf_after(self, node, removed):
        parent = self.parent[node]
        return parent if self.is_leaf(parent, removed) else None


def brute_force_order(tree: ToyTree) -> list[int]:
    removed: set[int] = set()
    order = []
    while True:
        leaves = [n for n in range(len(tree.parent)) if tree.is_leaf(n, removed)]
        if not leaves:
            return order
        victim = min(leaves, key=lambda n: (tree.priority_of[n], n))
        removed.add(victim)
        order.append(victim)


@st.composite
def toy_trees(draw) -> ToyTree:
    n = draw(st.integers(1, 25))
    parent = [0] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [0] + draw(st.lists(st.integers(1, 50), min_size=n - 1, max_size=n - 1))
    prio = [0.0] + draw(st.lists(st.floats(0, 1, allow_nan=False), min_size=n - 1, max_size=n - 1))
    locked: set[int] = set()
    for node in draw(st.sets(st.integers(0, n - 1), max_size=3)):
        while node:
            locked.add(node)
            node = parent[node]
    return ToyTree(parent, tokens, prio, locked)


@given(toy_trees())
def test_walk_order_equals_deleting_the_cheapest_leaf_repeatedly(tree):
    assert list(eviction_order(tree)) == brute_force_order(tree)


@given(toy_trees(), st.integers(0, 400))
def test_estimate_stops_like_the_eviction_loop(tree, n_tokens):
    order = brute_force_order(tree)
    result = estimate(tree, n_tokens, cost_s=lambda node: tree.priority_of[node] * tree.tokens_of[node])
    taken = list(result.nodes)
    assert taken == order[:len(taken)]
    assert result.tokens == sum(tree.tokens_of[n] for n in taken)
    assert not set(taken) & tree.locked
    available = sum(tree.tokens_of[n] for n in order)
    assert result.covered == (n_tokens <= available)
    if n_tokens > 0 and taken:  # no node beyond the one that reached the target
        assert result.tokens - tree.tokens_of[taken[-1]] < n_tokens
    assert result.cost_s == pytest.approx(sum(tree.priority_of[n] * tree.tokens_of[n] for n in taken))


def test_parent_follows_its_last_child():
    # 0 -> 1 -> {2, 3}; 1 is cheapest but must wait for both children
    tree = ToyTree(parent=[0, 0, 1, 1], tokens_of=[0, 10, 5, 5], priority_of=[0, 0.0, 0.9, 0.5])
    assert list(eviction_order(tree)) == [3, 2, 1]


def test_negative_request_is_refused():
    tree = ToyTree(parent=[0], tokens_of=[0], priority_of=[0.0])
    with pytest.raises(ValueError, match="n_tokens >= 0"):
        estimate(tree, -1, cost_s=lambda n: 0.0)
