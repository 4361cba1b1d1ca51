"""The eviction order kept between shortfalls: evictable leaves bucketed by a time-invariant key.

The order (cache/ordering.py) puts nodes not expected back first, by p_eff (Eq. 1), then nodes expected
back, never-hit before hit, by farthest expected next use T. T is fixed while a node's statistics and
its class's published interval are, so the expected-back leaves are two heaps per request priority
(never hit, hit), keyed by (-T, -created), exact; another heap holds their deadlines (the step after
which a node is no longer expected back), and every walk first moves the leaves whose deadline has
passed to the p_eff buckets (once each: time only moves forward).

p_eff = alpha * r_hit / (1 + age / tau) decays hyperbolically, and two nodes' p_eff cross as
time passes (a warm old node and a cold fresh one swap), so no key fixed at insertion orders nodes by
p_eff at every later step. What is invariant: for nodes with the same r_hit, p_eff at any step is
non-decreasing in the last-use step, and r_hit itself only changes when the node's own statistics do.
So those leaves are kept in buckets of similar r_hit (geometric, 2^(1/128) wide, plus an exact bucket for
r_hit = 0, newest first), each a heap by (last_step, created_step, id); a bucket's lower edge r_low gives every
member a LOWER BOUND of its p_eff at any step, LB = alpha * r_low / (1 + age / tau) (the same float
expression as Eq. 1 with a smaller r, so never above the real value), non-decreasing in the bucket's
order. A walk enumerates the buckets' entries in order of (priority, group, LB, ...) through one
frontier heap and moves them into an exact heap keyed by the tree's real priority tuple; it yields
the exact heap's head only once that head is below every bound not yet taken. Since each bound is at
most its node's real key, the order is the full re-sort's exactly (`tests/test_radix_kept_order.py`
checks it against SGLang's heap on random operation sequences), at the cost of the nodes whose bound
falls below the last one evicted, not of every leaf: those within one bucket width (0.5%) of its p_eff. Buckets
2^(1/8) wide priced ten times the leaves a walk yields where many leaves share an r_hit (27 pricings per
256-token eviction in `eval.bench_tree`'s drain, 3.1 at 2^(1/128)); a bucket holds only equal or nearly equal
r_hit values (hits and writer classes are few), so narrower ones add few buckets (2.8 to 3.8 per walk there).

A leaf must be re-filed (`add`) whenever its statistics change: an expected-back entry is exact, and a
node used again may be expected later than it said. The tree re-files through SGLang's leaf-set updates
(a lock takes the leaf out, an unlock puts it back) and its own touch. A never-hit node's prior and interval
are its writer class's published ones (cache/reuse_share.py), which can move, so a class's nodes are
re-filed when either moved since they were filed (rarely: they are published in steps of 2^(1/8)).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from typing import Any

from vamp_sglang.cache.ordering import EXPECTED, NOT_EXPECTED, expected_back_until, reuse_interval_steps
from vamp_sglang.cache.reuse_share import writer_class

BUCKETS_PER_OCTAVE = 128  # a bound is within 0.5% of its leaf's r_hit
ZERO_BUCKET = -(10 ** 9)  # r_hit == 0: p_eff is 0 at every step, the bound is exact
EXPECTED_BUCKET = 10 ** 9  # expected back (+1: and hit): entries (-T, -created, id), the bound is exact
_SAFETY = 1.0 - 2.0 ** -40  # r_low below every r_hit of its bucket despite rounding

# (request priority, hits, last step, created step, writer's hit rate or None) of a node
Describe = Callable[[Any], tuple[int, int, int, int, "float | None"]]


def bucket_of(r_hit: float) -> int:
    if r_hit <= 0.0:
        return ZERO_BUCKET
    b = math.floor(math.log2(r_hit) * BUCKETS_PER_OCTAVE)
    while bucket_low(b) > r_hit:
        b -= 1
    return b


def bucket_low(b: int) -> float:
    return 0.0 if b == ZERO_BUCKET else 2.0 ** (b / BUCKETS_PER_OCTAVE) * _SAFETY


class LeafOrder:
    """The evictable leaves of one tree, bucketed as the module says; updated as leaves come and go."""

    def __init__(self, alpha: float, tau_steps: float, describe: Describe) -> None:
        self.alpha, self.tau_steps, self.describe = alpha, tau_steps, describe
        self.buckets: dict[tuple[int, int], list[tuple]] = {}  # (priority, bucket) -> heap of entries
        # id -> (bucket key, heap entry, described, node); heap entries are (last, created, id) ((-created, last, id)
        # in the zero bucket, (-T, -created, id) expected back) and never hold the node, so a node SGLang drops
        # is freed then, not when a later walk pops its dead entry
        self.entries: dict[int, tuple[tuple[int, int], tuple, tuple, Any]] = {}
        self.dead = 0  # entries left in a heap after their node left or was re-bucketed
        self.deferred: list[tuple] = []  # (bucket key, entry) filed while a walk was open, not yet in a heap
        self.open_walks = 0  # walks started and not closed: they read the heaps by position
        self.by_class: dict[int | None, set[int]] = {}  # writer class -> ids of its nodes
        self.priors: dict[int | None, float] = {}  # writer class -> the prior its nodes were bucketed with
        self.gaps: dict[int | None, float] = {}  # writer class -> its published steps to a first hit
        self.deadlines: list[tuple[float, tuple]] = []  # heap of (expected back until, entry)
        self.now = 0  # the latest step a walk ran at: a node filed later is expected back only if still due
        self.walking: OrderedWalk | None = None  # a live eviction walk in progress (sees new leaves)

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.buckets.clear()
        self.entries.clear()
        self.by_class.clear()
        self.deferred = []
        self.deadlines = []
        self.dead = 0

    def add(self, node: Any) -> None:
        """`node` is (still) an evictable leaf: (re)bucket it if its statistics moved."""
        if self.place(node) and self.walking is not None:
            self.walking.push(node)  # a leaf freed by the live walk's own eviction
        if not self.open_walks:
            self.tidy()

    def place(self, node: Any, force: bool = False) -> bool:
        """Record `node`'s current bucket and push its heap entry, as the insert, lock or unlock happens, so a
        walk finds it filed; while a walk is open the entry waits in `deferred` for the next one (a walk reads
        the heaps by position, so they only change between walks). False: nothing moved."""
        described = self.describe(node)
        old = self.entries.get(node.id)
        if old is not None and old[2] == described and not force:
            return False
        priority, hits, last, created, writer_rate = described
        cls = writer_class(writer_rate)
        if old is not None and (old_cls := writer_class(old[2][4])) != cls:
            self.by_class[old_cls].discard(node.id)
        self.by_class.setdefault(cls, set()).add(node.id)
        rho = self.priors.get(cls, 0.0)  # 0 bounds every prior; re-filed once the class is published
        r_hit = (hits + rho) / (hits + 1)
        key, entry = (priority, bucket_of(r_hit)), (last, created, node.id)
        gap = reuse_interval_steps(node.vamp_stats, r_hit, self.gaps.get(cls))
        if gap is not None:
            until = expected_back_until(node.vamp_stats, gap)
            if until >= self.now:
                key, entry = (priority, EXPECTED_BUCKET + (1 if hits else 0)), (-(last + gap), -created, node.id)
                heapq.heappush(self.deadlines, (until, entry))
        if key[1] == ZERO_BUCKET:
            entry = (-created, last, node.id)
        if old is not None:
            self.dead += 1
        self.entries[node.id] = (key, entry, described, node)
        if self.open_walks:
            self.deferred.append((key, entry))
        else:
            heapq.heappush(self.buckets.setdefault(key, []), entry)
        return True

    def discard(self, node: Any) -> None:
        old = self.entries.pop(node.id, None)
        if old is not None:
            self.dead += 1
            self.by_class[writer_class(old[2][4])].discard(node.id)
            if not self.open_walks:
                self.tidy()

    def flush(self) -> None:
        for key, entry in self.deferred:
            current = self.entries.get(entry[2])
            if current is not None and current[1] is entry:
                heapq.heappush(self.buckets.setdefault(key, []), entry)
            else:
                self.dead += 1
        self.deferred = []

    def prepare(self, now: float, priors: dict[int | None, float], gaps: dict[int | None, float]) -> None:
        """Before a walk at step `now`: re-file the nodes of each writer class whose published prior or
        interval moved and the nodes no longer expected back, file the deferred entries, drop dead ones (at
        every heap's top; all of them once they outnumber the live)."""
        moved = {cls for cls, prior in priors.items() if self.priors.get(cls) != prior}
        moved |= {cls for cls in set(gaps) | set(self.gaps) if self.gaps.get(cls) != gaps.get(cls)}
        self.priors, self.gaps, self.now = dict(priors), dict(gaps), max(self.now, now)
        for cls in moved:
            for node_id in list(self.by_class.get(cls, ())):
                self.place(self.entries[node_id][3], force=True)
        deadlines, entries = self.deadlines, self.entries
        while deadlines and deadlines[0][0] < self.now:
            entry = heapq.heappop(deadlines)[1]
            current = entries.get(entry[2])
            if current is not None and current[1] is entry:
                self.place(current[3], force=True)
        self.flush()
        self.tidy()
        for heap in self.buckets.values():  # every walk reads from the tops: drop the dead entries there, once
            while heap:
                current = entries.get(heap[0][2])
                if current is not None and current[1] is heap[0]:
                    break
                heapq.heappop(heap)
                self.dead -= 1

    def tidy(self) -> None:
        """Rebuild the heaps from the live entries once the dead ones outnumber them: every re-filing leaves
        one dead entry behind, and a tree that never falls short never walks, so without this its heaps would
        grow for good and its first walk would pop them all (0.3 s on `eval.bench_decision`'s 100,323-node
        tree). A rebuild costs O(leaves) after at least as many re-filings: O(1) per filing. Only between walks."""
        entries = self.entries
        if self.dead > len(entries) + 64:
            self.buckets = {}
            for key, entry, _, _ in entries.values():
                self.buckets.setdefault(key, []).append(entry)
            for heap in self.buckets.values():
                heapq.heapify(heap)
            self.dead = 0
        if len(self.deadlines) > 2 * len(entries) + 64:
            self.deadlines = [(until, entry) for until, entry in self.deadlines
                              if (current := entries.get(entry[2])) is not None and current[1] is entry]
            heapq.heapify(self.deadlines)

    def bound(self, key: tuple[int, int], entry: tuple, now: float) -> tuple:
        """At most the tree's priority tuple of the node: exact expected back and in the zero bucket,
        (1, priority, NOT_EXPECTED, LB of p_eff, last, created) in the others."""
        if key[1] >= EXPECTED_BUCKET:
            return (1, key[0], EXPECTED, key[1] - EXPECTED_BUCKET, entry[0], entry[1])
        if key[1] == ZERO_BUCKET:
            return (1, key[0], NOT_EXPECTED, 0.0, entry[0], entry[1])
        age = max(now - entry[0], 0)
        return (1, key[0], NOT_EXPECTED, self.alpha * bucket_low(key[1]) / (1.0 + age / self.tau_steps),
                entry[0], entry[1])

    def walk(self, now: float, priors: dict[int | None, float], gaps: dict[int | None, float],
             exact: Callable[[Any], tuple], admits: Callable[[Any], bool], live: bool = False) -> OrderedWalk:
        """Leaves smallest `exact` key first, `exact` pricing never-hit nodes with `priors` and `gaps`
        (writer class -> prior, -> steps to a first hit). `admits(node)`: still a candidate (not taken,
        still a leaf); `live`: the caller evicts what it is given, and the leaves that frees join the walk."""
        self.prepare(now, priors, gaps)
        return OrderedWalk(self, now, exact, admits, live)


class OrderedWalk:
    """One pass over a `LeafOrder` (see the module); `push` adds a node (a parent that became a leaf)."""

    def __init__(self, order: LeafOrder, now: float, exact: Callable[[Any], tuple],
                 admits: Callable[[Any], bool], live: bool) -> None:
        self.order, self.now, self.exact, self.admits, self.live = order, now, exact, admits, live
        self.frontier = [(order.bound(key, heap[0], now), key, 0) for key, heap in order.buckets.items() if heap]
        heapq.heapify(self.frontier)
        self.ready: list[tuple[tuple, Any]] = []  # (exact key, node), as SGLang's eviction heap holds them
        self.seen: set[int] = set()
        self.open = True
        order.open_walks += 1
        if live:
            order.walking = self

    def push(self, node: Any) -> None:
        if node.id not in self.seen:
            self.seen.add(node.id)
            heapq.heappush(self.ready, (self.exact(node), node))

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        ready, frontier = self.ready, self.frontier
        while True:
            if ready and (not frontier or ready[0][0] < frontier[0][0]):
                node = heapq.heappop(ready)[1]
                if self.admits(node):
                    return node
                continue
            if not frontier:
                self.close()
                raise StopIteration
            self._pull()

    def _pull(self) -> None:
        order = self.order
        _, key, i = heapq.heappop(self.frontier)
        heap = order.buckets[key]
        for child in (2 * i + 1, 2 * i + 2):
            if child < len(heap):
                heapq.heappush(self.frontier, (order.bound(key, heap[child], self.now), key, child))
        entry = heap[i]
        current = order.entries.get(entry[2])
        if current is None or current[1] is not entry or entry[2] in self.seen:
            return
        node = current[3]
        if not self.admits(node):
            return
        if current[2] != order.describe(node):
            order.place(node)  # grew since bucketed: refiled for later walks (still a bound for this one)
        self.push(node)

    def close(self) -> None:
        """Done with the walk (also when it ran out): entries filed from now on go straight to their heaps."""
        if self.open:
            self.open = False
            self.order.open_walks -= 1
            if not self.order.open_walks:
                self.order.flush()  # what was filed during the walk, so the next one starts with it in place
        if self.order.walking is self:
            self.order.walking = None
