"""A read-only replay of the tree's eviction loop: which nodes would go, in which order, at what cost.

The planner must price "evict N tokens" before anything is evicted (paper IV-B compares it with
offloading and preemption), so this walk reproduces SGLang's device eviction loop
(`FullComponent._evict_device_start/_next_node`: a heap of `(priority, node)` over the evictable
leaves; pop the smallest; once a parent's last device child is gone, the parent is pushed) on
a simulated removal set, and never touches the tree. Given the same priority function it predicts
the real eviction exactly, which the state-machine test checks.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

N = TypeVar("N")


class EvictableTree(Protocol[N]):
    """What the walk needs from a tree; nodes must be hashable and ordered (SGLang's are)."""

    def evictable_leaves(self) -> Iterable[N]: ...

    def priority(self, node: N) -> Any: ...  # the exact key the real eviction heap orders by

    def tokens(self, node: N) -> int: ...  # KV tokens the allocator gets back if the node goes

    def parent_if_leaf_after(self, node: N, removed: set[N]) -> N | None:
        """The parent, if it would be an evictable leaf once every node in `removed` is gone."""
        ...


def eviction_order(tree: EvictableTree[N]) -> Iterator[N]:
    """Nodes in the order the tree would evict them if asked to free everything evictable."""
    heap = [(tree.priority(n), n) for n in tree.evictable_leaves()]
    heapq.heapify(heap)
    removed: set[N] = set()
    while heap:
        _, node = heapq.heappop(heap)
        if node in removed:
            continue
        removed.add(node)
        yield node
        parent = tree.parent_if_leaf_after(node, removed)
        if parent is not None:
            heapq.heappush(heap, (tree.priority(parent), parent))


@dataclass(frozen=True)
class EvictionEstimate(Generic[N]):
    """What asking the tree to free `requested_tokens` would do: whole nodes go, so `tokens` may exceed it."""

    requested_tokens: int
    tokens: int
    cost_s: float
    nodes: tuple[N, ...]

    @property
    def covered(self) -> bool:
        return self.tokens >= self.requested_tokens


def estimate(tree: EvictableTree[N], n_tokens: int, cost_s: Callable[[N], float],
             order: Iterable[N] | None = None) -> EvictionEstimate[N]:
    """Free at least `n_tokens` the way the tree would (stopping as SGLang's loop does), summing C_c.
    `order`: the nodes in eviction order if the tree keeps it (default: `eviction_order(tree)`)."""
    if n_tokens < 0:
        raise ValueError(f"estimate needs n_tokens >= 0 (got {n_tokens!r})")
    freed, total_s, nodes = 0, 0.0, []
    if n_tokens > 0:
        for node in eviction_order(tree) if order is None else order:
            freed += tree.tokens(node)
            total_s += cost_s(node)
            nodes.append(node)
            if freed >= n_tokens:
                break
    return EvictionEstimate(n_tokens, freed, total_s, tuple(nodes))
