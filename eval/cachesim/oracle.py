"""The future of a replay, known offline: who reads which cached prefix next (Belady's oracle).

A compressed trie of every sequence the replay writes (each request's prompt and answer), split
so that every prompt ends on a node boundary. Each trie node lists, in replay order, the requests
whose prompt covers it; so the next use of any cached token is one bisection away. From the same
pass: the prefix an unbounded cache would serve each request (written by an earlier request), and
the trace's reusable footprint (tokens written by one request and read by a later one), the scale
the pool sizes are given against.

`OptStrategy` is the offline optimum under the radix constraint as an SGLang eviction strategy:
among the evictable leaves, the one whose next use is farthest in the future goes first (never
used again: first of all, least recently used first among those).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from eval.cachesim.workload import SimRequest

NEVER = 1 << 62


class TrieNode:
    __slots__ = ("children", "cover", "length", "reused", "seq", "start", "uses")

    def __init__(self, seq: list[int], start: int, length: int) -> None:
        self.seq, self.start, self.length = seq, start, length  # tokens: seq[start:start + length]
        self.children: dict[int, TrieNode] = {}
        self.uses: list[int] = []  # requests whose prompt covers this node, in replay order
        self.cover = start  # depth up to which requests processed so far wrote this node
        self.reused = 0  # tokens of this node some request read after another wrote them

    @property
    def end(self) -> int:
        return self.start + self.length


def _common(a: list[int], b: list[int], start: int, n: int) -> int:
    """Length of the common run of a and b from `start`, at most n (C-level slice compares)."""
    if a[start:start + n] == b[start:start + n]:
        return n
    lo, hi = 0, n  # a[start:start+lo] equal, a[start:start+hi] not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[start:start + mid] == b[start:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class FutureTrie:
    def __init__(self, requests: list[SimRequest]) -> None:
        self.root = TrieNode([], 0, 0)
        for request in requests:
            self._insert(request.tokens)
        for request in requests:
            self._split_at(request.prompt, len(request.prompt))
        self.unbounded_hits: list[int] = []
        for request in requests:
            self._record(request)
        self.reusable_tokens = sum(node.reused for node in self.nodes())

    # --- building ---------------------------------------------------------------------------------
    def _split(self, parent: TrieNode, child: TrieNode, m: int) -> TrieNode:
        head = TrieNode(child.seq, child.start, m)
        parent.children[child.seq[child.start]] = head
        child.start, child.length = child.start + m, child.length - m
        head.children[child.seq[child.start]] = child
        return head

    def _insert(self, seq: list[int]) -> None:
        node, d = self.root, 0
        while d < len(seq):
            child = node.children.get(seq[d])
            if child is None:
                node.children[seq[d]] = TrieNode(seq, d, len(seq) - d)
                return
            n = min(child.length, len(seq) - d)
            m = _common(child.seq, seq, d, n)
            if m < n:
                child = self._split(node, child, m)
            node, d = child, d + m

    def _split_at(self, seq: list[int], depth: int) -> None:
        """Make `depth` a node boundary on the path of `seq`."""
        node = self.root
        while node.end < depth:
            child = node.children[seq[node.end]]
            if child.end > depth:
                self._split(node, child, depth - child.start)
                return
            node = child

    def path(self, seq: list[int], depth: int) -> Iterator[TrieNode]:
        """The nodes covering seq[:depth] from the root (the last may reach past `depth`)."""
        node = self.root
        while node.end < depth:
            node = node.children[seq[node.end]]
            yield node

    def _record(self, request: SimRequest) -> None:
        prompt, hit, open_run = request.prompt, 0, True
        for node in self.path(prompt, len(prompt)):
            node.uses.append(request.index)
            if open_run:
                served = min(node.cover, node.end) - node.start
                hit += served
                node.reused = max(node.reused, served)
                open_run = served == node.length
        self.unbounded_hits.append(hit)
        seq = request.tokens
        for node in self.path(seq, len(seq)):
            node.cover = max(node.cover, min(node.end, len(seq)))

    def nodes(self) -> Iterator[TrieNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # --- queries ----------------------------------------------------------------------------------
    def next_use(self, node: TrieNode, now: int) -> int:
        """The first request at or after `now` that reads `node` (NEVER if none)."""
        k = bisect_left(node.uses, now)
        return node.uses[k] if k < len(node.uses) else NEVER


class LiveLocator:
    """Where a live SGLang tree node sits in the trie: the trie node holding its first token.

    Memoised per node id with its key length: a split shortens a node's key from the front (its
    end depth stays), a split above it changes nothing about it, so the key length tells a stale
    entry. Walks down from where the parent ends."""

    def __init__(self, trie: FutureTrie, root: Any) -> None:
        self.trie, self.live_root = trie, root
        self._memo: dict[int, tuple[int, TrieNode, TrieNode, int]] = {}  # id -> (key len, first, last, end)

    def _locate(self, node: Any) -> tuple[int, TrieNode, TrieNode, int]:
        key = node.key.token_ids
        memo = self._memo.get(node.id)
        if memo is not None and memo[0] == len(key):
            return memo
        parent = node.parent
        if parent is self.live_root:
            at, depth = self.trie.root, 0
        else:
            _, _, at, depth = self._locate(parent)
        first = at if depth < at.end else at.children[key[0]]
        last, end = first, depth + len(key)
        while last.end < end:
            last = last.children[key[last.end - depth]]
        memo = self._memo[node.id] = (len(key), first, last, end)
        return memo

    def first(self, node: Any) -> TrieNode:
        return self._locate(node)[1]


class OptStrategy(EvictionStrategy):
    """Farthest next use first; ties (never used again) least recently used first."""

    def __init__(self, trie: FutureTrie, locator: LiveLocator, now: Callable[[], int]) -> None:
        self.trie, self.locator, self.now = trie, locator, now

    def get_priority(self, node: Any) -> tuple[int, float]:
        return (-self.trie.next_use(self.locator.first(node), self.now()), node.last_access_time)
