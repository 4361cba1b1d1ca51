"""`bound`: the offline optimum at token granularity, an upper bound on every policy's token hits.

The issue's `opt` (oracle.OptStrategy) is Belady under SGLang's radix constraint: among evictable
LEAVES, the farthest next use goes first, whole nodes at a time. With nodes of different sizes
that is not optimal (variable-size caching is NP-hard; tests/test_cachesim.py finds tiny traces
where LFU or VAMP beat it). Relax the granularity: let eviction drop any number of tokens from the
end of a cached path. Every token then costs one slot and serves one hit token, and a request's
tokens are needed together, so farthest-next-use over tokens (Belady) is optimal among policies
that evict lazily, and so never below any node-granular policy (each of which is such a policy).
Within a trie node (oracle.FutureTrie) all tokens share their next use, and next uses never
decrease down a path, so the farthest token is always at the end of a cached path and the cache
stays prefix-closed. One request at a time only (in flight requests would need the scheduler's
admission rule, which the relaxation does not model).

Pure Python over the trie, no SGLang: a heap of the cached paths' end nodes keyed by next use,
re-keyed when a request reads a node (the only time a next use changes).
"""

from __future__ import annotations

import heapq
from itertools import count

from eval.cachesim.oracle import FutureTrie, TrieNode
from eval.cachesim.workload import SimRequest


class _Cache:
    def __init__(self, trie: FutureTrie, pool_tokens: int) -> None:
        self.trie, self.pool, self.used = trie, pool_tokens, 0
        self.resident: dict[TrieNode, int] = {}  # cached tokens of a node, from its start
        self.cached_children: dict[TrieNode, int] = {}
        self.parent: dict[TrieNode, TrieNode] = {}
        self.key: dict[TrieNode, int] = {}
        self.heap: list[tuple[int, int, TrieNode]] = []
        self.tie = count()
        self.evicted = 0

    def push(self, node: TrieNode, next_use: int) -> None:
        self.key[node] = next_use
        if self.resident.get(node) and not self.cached_children.get(node):
            heapq.heappush(self.heap, (-next_use, next(self.tie), node))

    def evict(self, tokens: int) -> None:
        while tokens > 0:
            neg, _, node = heapq.heappop(self.heap)
            if -neg != self.key.get(node) or not self.resident.get(node) or self.cached_children.get(node):
                continue  # stale entry
            take = min(tokens, self.resident[node])
            self.resident[node] -= take
            self.used -= take
            self.evicted += take
            tokens -= take
            if self.resident[node]:
                heapq.heappush(self.heap, (neg, next(self.tie), node))
                continue
            parent = self.parent[node]
            self.cached_children[parent] -= 1
            if parent is not self.trie.root:
                self.push(parent, self.key[parent])

    def write(self, seq: list[int], now: int) -> None:
        parent = self.trie.root
        for node in self.trie.path(seq, len(seq)):
            want = min(node.length, len(seq) - node.start)
            have = self.resident.get(node, 0)
            if want > have:
                if not have:
                    self.cached_children[parent] = self.cached_children.get(parent, 0) + 1
                    self.parent[node] = parent
                self.resident[node] = want
                self.used += want - have
            self.push(node, self.trie.next_use(node, now + 1))
            parent = node


def simulate_bound(requests: list[SimRequest], trie: FutureTrie, pool_tokens: int) -> dict[str, float | int]:
    """The same metrics as sim.simulate, for the token-granular optimum."""
    cache = _Cache(trie, pool_tokens)
    hits = [0] * len(requests)
    for request in requests:
        prompt, hit = request.prompt, 0
        path = list(trie.path(prompt, len(prompt)))
        for node in path:
            have = cache.resident.get(node, 0)
            hit += have
            if have < node.length:
                break
        locked = hit
        need = len(prompt) + len(request.answer) - hit
        if need > pool_tokens - locked:
            continue  # larger than the pool: served uncached, as in sim.simulate
        for node in path:  # read now: next uses move on (also keeps the read prefix off the heap top)
            cache.key[node] = request.index
        shortfall = need - (pool_tokens - cache.used)
        if shortfall > 0:
            cache.evict(shortfall)
        hits[request.index] = hit
        cache.write(request.tokens, request.index)
    later = [r for r in requests if r.turn > 0]
    prompt_tokens = sum(len(r.prompt) for r in later)
    return {"hit_rate": sum(hits[r.index] for r in later) / prompt_tokens if prompt_tokens else 0.0,
            "reprefill_tokens": sum(max(0, u - h) for u, h in zip(trie.unbounded_hits, hits)),
            "evictions": cache.evicted}
