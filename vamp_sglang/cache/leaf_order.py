"""The eviction order kept between shortfalls: evictable leaves in groups whose order does not change with time.

The order (cache/ordering.py) puts nodes not expected back first, by p_eff (Eq. 1), then nodes expected
back, never-hit before hit, by farthest expected next use T. T is fixed while a node's statistics and
its class's published interval are, so the expected-back leaves are two heaps per rank (never hit, hit), keyed by (-T, -created), exact; another heap holds their deadlines (the step after
which a node is no longer expected back), and every walk first moves the leaves whose deadline has
passed to the p_eff groups (once each: time only moves forward).

p_eff = alpha * r_hit / (1 + age / tau) decays hyperbolically, and two nodes' p_eff cross as time passes
(a warm old node and a cold fresh one swap), so no key fixed at insertion orders nodes by p_eff at every
later step. What is invariant: r_hit = (hits + prior) / (hits + 1) is the same for every node with the
same hits and writer class (its prior is the class's published one), and for those nodes p_eff at any
step is non-decreasing in the last-use step. So those leaves are kept in groups by (request priority,
writer class, hits), each a heap by (last_step, -created_step, id), plus one group for r_hit = 0 (never
hit, class prior 0), newest first. A group's bound for an entry is its p_eff computed when the walk
runs, with the class's prior at that step: the same float expression as Eq. 1, so equal to the node's,
and non-decreasing in the group's order; where p_eff rises strictly with the last use (`_tail_holds`) the
bound is the node's whole key (p_eff, -created, last), still non-decreasing in that heap order, so leaves
last used in one step (a batch finishing together) do not tie. A walk enumerates the groups' entries in order
of these bounds through one frontier heap and moves them into an exact heap keyed by the tree's real priority
tuple; it yields the exact heap's head only once that head is below every bound not yet taken. Since each
bound is at most its node's real key, the order is the full re-sort's exactly (`tests/test_radix_kept_order.py`
checks it against SGLang's heap on random operation sequences), at the cost of the nodes whose key ties the
last one evicted, not of every leaf. Where the tree breaks ties by node id (`ties_by_id`: the Rust core's
mirror), whole-key bounds and the exact keys end with the id, and nothing ties
(`tests/test_radix_tied_leaves.py`).

With SGLang's radix-native sessions (`--enable-session-radix-cache`) SGLang orders leaves by (held by an open
session, how many, the tree's priority): the rank of every group is then (open, refs, request priority) instead
of the request priority alone, and a leaf is re-filed when a session's coverage moves over it.

A leaf must be re-filed (`add`) whenever its statistics change: an expected-back entry is exact, and a
node used again may be expected later than it said. The tree re-files through SGLang's leaf-set updates
(a lock takes the leaf out, an unlock puts it back) and its own touch. A class's published prior and
interval move (cache/reuse_share.py, in steps of 2^(1/8)) without re-filing its hit leaves (r_hit >= 1/2
is expected back by its own interval, or priced with the prior read at walk time) or its never-hit
leaves, unless their mode moves (`class_mode`): prior 0 or not, expected back or not (prior at least
`EXPECTED_MIN_REUSE` with an interval), and the interval itself while they are expected back. A class not
published yet is filed by p_eff, so a tree filled before its first walk is not re-filed at that walk unless
its classes turn out expected back or at 0. Re-filing every leaf of a class cost ~6 us each, at the decision
where its prior moved (15 ms on `eval.bench_decision`'s 100,323-node tree).
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from vamp_sglang.cache.ordering import (
    EXPECTED,
    EXPECTED_MIN_REUSE,
    NOT_EXPECTED,
    expected_back_until,
    reuse_interval_steps,
)
from vamp_sglang.cache.reuse_share import writer_class

# a group key is (rank, kind, writer class code, hits); the class and hits only for P_EFF; the rank is the request
# priority, or with sessions (open, refs, request priority)
ZERO, P_EFF, EXPECTED_NEVER_HIT, EXPECTED_HIT = 0, 1, 2, 3  # kinds: r_hit = 0 (exact), by p_eff, expected back
assert EXPECTED_MIN_REUSE <= 0.5, "a hit node's r_hit >= 1/2 must be expected back whatever its class prior"

# below this many steps (tau, and the step a walk runs at) p_eff falls strictly with every step of age (`_tail_holds`)
TAIL_STEPS = 2.0 ** 40

# (rank, hits, last step, created step, writer's hit rate or None) of a node
Describe = Callable[[Any], tuple[int, int, int, int, "float | None"]]


def class_mode(prior: float | None, gap_steps: float | None) -> object:
    """What a never-hit node's filing depends on in its class's published prior (None: not published yet,
    filed by p_eff, whose bound a walk reads with the prior of its step) and interval."""
    if prior is None:
        return P_EFF
    if prior <= 0.0:
        return ZERO
    if prior >= EXPECTED_MIN_REUSE and gap_steps is not None:
        return ("expected back after", gap_steps)
    return P_EFF


class LeafOrder:
    """The evictable leaves of one tree, in groups as the module says; updated as leaves come and go."""

    def __init__(self, alpha: float, tau_steps: float, describe: Describe, sessions: bool = False,
                 ties_by_id: bool = False) -> None:
        self.alpha, self.tau_steps, self.describe = alpha, tau_steps, describe
        # the tree breaks ties between equal keys by node id (the Rust core's mirror; SGLang's Python nodes break
        # them by their last access, which the order does not follow): its keys (a walk's `exact`), and a bound
        # that is a whole key, end with the id
        self.ties_by_id = ties_by_id
        # sessions: a leaf's rank is (held by an open session, open sessions holding it, request priority), the
        # head of SGLang's session-ref key (ref > 0, ref, the tree's priority) wrapped around the tree's priority
        self.sessions = sessions
        self.groups: dict[tuple, list[tuple]] = {}  # group key -> heap of entries
        # id -> (group key, heap entry, described, node); heap entries are (last, -created, id) ((-created, last, id)
        # for r_hit = 0, (-T, -created, id) expected back) and never hold the node, so a node SGLang drops
        # is freed then, not when a later walk pops its dead entry
        self.entries: dict[int, tuple[tuple[int, int, int, int], tuple, tuple, Any]] = {}
        self.dead = 0  # entries left in a heap after their node left or was re-filed
        self.deferred: list[tuple] = []  # (group key, entry) filed while a walk was open, not yet in a heap
        # walks started, not closed nor dropped (a dropped walk's reference removes itself): plain weak references in
        # a list, not a WeakSet, whose Python-level iteration and length cost more than the rest of a re-filing
        self.walks: list[weakref.ref[OrderedWalk]] = []
        self.generation = 0  # bumped by every prepare, which moves heap entries an open walk points at
        self.never_hit: dict[int | None, set[int]] = {}  # writer class -> ids of its never-hit nodes
        self.priors: dict[int | None, float] = {}  # writer class -> its published prior at the latest walk
        self.gaps: dict[int | None, float] = {}  # writer class -> its published steps to a first hit
        self.rates: dict[tuple, tuple[float, bool]] = {}  # P_EFF group key -> its r_hit at those priors, tail holds
        self.deadlines: list[tuple[float, tuple]] = []  # heap of (expected back until, entry)
        self.now = 0  # the latest step a walk ran at: a node filed later is expected back only if still due

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def open_walks(self) -> int:
        """Walks open now: they read the heaps by position, so what is filed meanwhile waits in `deferred`."""
        return len(self.walks)

    def forget(self, walk: weakref.ref[OrderedWalk]) -> None:
        """`walk` is closed, or dropped without closing."""
        if walk in self.walks:
            self.walks.remove(walk)

    def clear(self) -> None:
        self.generation += 1  # an open walk's positions point into heaps that are gone
        self.groups.clear()
        self.entries.clear()
        self.never_hit.clear()
        self.deferred = []
        self.deadlines = []
        self.dead = 0

    def add(self, node: Any) -> None:
        """`node` is (still) an evictable leaf: re-file it if its statistics moved. Every open walk takes it at
        its new key (a leaf the eviction's own walk freed, or one re-filed while a planner walk is paused)."""
        if self.place(node):
            for ref in list(self.walks):
                walk = ref()
                if walk is not None:
                    walk.push(node)
        if not self.open_walks:
            self.tidy()

    def place(self, node: Any, force: bool = False) -> bool:
        """Record `node`'s current group and push its heap entry, as the insert, lock or unlock happens, so a
        walk finds it filed; while a walk is open the entry waits in `deferred` for the next one (a walk reads
        the heaps by position, so they only change between walks). False: nothing moved."""
        described = self.describe(node)
        old = self.entries.get(node.id)
        if old is not None and old[2] == described and not force:
            return False
        rank, hits, last, created, writer_rate = described
        cls = writer_class(writer_rate)
        if old is not None and not old[2][1]:
            self.never_hit[writer_class(old[2][4])].discard(node.id)
        if not hits:
            self.never_hit.setdefault(cls, set()).add(node.id)
        rho = self.priors.get(cls)
        r_hit = (hits + (rho or 0.0)) / (hits + 1)
        key, entry = (rank, P_EFF, -1 if cls is None else cls, hits), (last, -created, node.id)
        gap = reuse_interval_steps(node.vamp_stats, r_hit, self.gaps.get(cls))
        if gap is not None and (until := expected_back_until(node.vamp_stats, gap)) >= self.now:
            key, entry = (rank, EXPECTED_HIT if hits else EXPECTED_NEVER_HIT, 0, 0), (-(last + gap), -created, node.id)
            heapq.heappush(self.deadlines, (until, entry))
        elif r_hit <= 0.0 and rho is not None:
            key, entry = (rank, ZERO, 0, 0), (-created, last, node.id)
        if old is not None:
            self.dead += 1
        self.entries[node.id] = (key, entry, described, node)
        if self.open_walks:
            self.deferred.append((key, entry))
        else:
            heapq.heappush(self.groups.setdefault(key, []), entry)
        return True

    def discard(self, node: Any) -> None:
        old = self.entries.pop(node.id, None)
        if old is not None:
            self.dead += 1
            if not old[2][1]:
                self.never_hit[writer_class(old[2][4])].discard(node.id)
            if not self.open_walks:
                self.tidy()

    def flush(self) -> None:
        for key, entry in self.deferred:
            current = self.entries.get(entry[2])
            if current is not None and current[1] is entry:
                heapq.heappush(self.groups.setdefault(key, []), entry)
            else:
                self.dead -= 1  # counted when it was superseded, but it never reached a heap
        self.deferred = []

    def prepare(self, now: float, priors: dict[int | None, float], gaps: dict[int | None, float]) -> None:
        """Before a walk at step `now`: take the published priors and intervals, re-file the never-hit nodes of
        each writer class whose mode (`class_mode`) moved and the nodes no longer expected back, file the
        deferred entries, drop dead ones (at every heap's top; all of them once they outnumber the live)."""
        moved = [] if priors == self.priors and gaps == self.gaps else [
            cls for cls in set(priors) | set(self.priors) | set(gaps) | set(self.gaps)
            if class_mode(priors.get(cls), gaps.get(cls)) != class_mode(self.priors.get(cls), self.gaps.get(cls))]
        self.generation += 1
        self.priors, self.gaps, self.now, self.rates = dict(priors), dict(gaps), max(self.now, now), {}
        for cls in moved:
            for node_id in list(self.never_hit.get(cls, ())):
                self.place(self.entries[node_id][3], force=True)
        deadlines, entries = self.deadlines, self.entries
        while deadlines and deadlines[0][0] < self.now:
            entry = heapq.heappop(deadlines)[1]
            current = entries.get(entry[2])
            if current is not None and current[1] is entry:
                self.place(current[3], force=True)
        self.flush()
        self.tidy()
        self.drop_dead_tops()

    def drop_dead_tops(self) -> None:
        """Every walk reads from the heaps' tops: drop the dead entries there, once. Also as a walk closes, so
        the leaves an eviction took are dropped by the eviction, not by the next decision. Only between walks."""
        entries = self.entries
        for heap in self.groups.values():
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
        if self.deferred:
            self.flush()  # filed while a walk was open that was dropped without closing
        entries = self.entries
        if self.dead > len(entries) + 64:
            self.groups = {}
            for key, entry, _, _ in entries.values():
                self.groups.setdefault(key, []).append(entry)
            for heap in self.groups.values():
                heapq.heapify(heap)
            self.dead = 0
        if len(self.deadlines) > 2 * len(entries) + 64:
            self.deadlines = [(until, entry) for until, entry in self.deadlines
                              if (current := entries.get(entry[2])) is not None and current[1] is entry]
            heapq.heapify(self.deadlines)

    def bound(self, key: tuple, entry: tuple, now: float) -> tuple:
        """At most the tree's priority tuple of the node, and non-decreasing in a group's heap order: the whole key
        (then with the id where ties break by it: `ties_by_id`) expected back, for r_hit = 0, and by p_eff where
        p_eff falls strictly with age (`_tail_holds`); else (1, priority, NOT_EXPECTED, p_eff), its prefix. With
        sessions inside the node's (open, refs) head."""
        rank, kind = key[0], key[1]
        priority = rank[2] if self.sessions else rank
        if kind >= EXPECTED_NEVER_HIT:
            value = (1, priority, EXPECTED, kind - EXPECTED_NEVER_HIT, entry[0], entry[1])
        elif kind == ZERO:
            value = (1, priority, NOT_EXPECTED, 0.0, entry[0], entry[1])
        else:
            rate = self.rates.get(key)
            if rate is None:
                hits = key[3]
                r_hit = (hits + self.priors.get(None if key[2] < 0 else key[2], 0.0)) / (hits + 1)
                rate = self.rates[key] = (r_hit, self._tail_holds(r_hit))
            r_hit, tail = rate
            last = entry[0]
            age = now - last if now > last else 0
            p_eff = self.alpha * r_hit / (1.0 + age / self.tau_steps)
            if not (tail and age and now < TAIL_STEPS):  # age 0 prices every later use alike: a prefix is below them
                value = (1, priority, NOT_EXPECTED, p_eff)
                return (rank[0], rank[1], value) if self.sessions else value
            value = (1, priority, NOT_EXPECTED, p_eff, entry[1], last)
        if self.sessions:
            return (rank[0], rank[1], value)
        return (*value, entry[2]) if self.ties_by_id else value

    def _tail_holds(self, r_hit: float) -> bool:
        """Within a group by p_eff the heap order is (last, -created): the key's tail (-created, last) is
        non-decreasing in it only if p_eff rises strictly with the last use. It does while the ages' steps stay
        far above float rounding (tau and the step below `TAIL_STEPS`, tau above its inverse: 1 + age / tau then moves
        by more than 2^-41 of itself per step, where the division rounds to 2^-53) and p_eff is far from underflow."""
        return r_hit * self.alpha > 2.0 ** -500 and 1.0 / TAIL_STEPS < self.tau_steps < TAIL_STEPS

    def filed_key(self, key: tuple, bound: tuple, entry: tuple) -> tuple:
        """Without sessions, the key a walk orders a node filed at `entry` in group `key` by, if its statistics
        still match: the tree's priority tuple (its `bound` where that is the whole key, else the bound with the
        tail (-created, last)), then with `ties_by_id` the id."""
        if len(bound) > 4:
            return bound
        return (*bound, entry[1], entry[0], entry[2]) if self.ties_by_id else (*bound, entry[1], entry[0])

    def walk(self, now: float, priors: dict[int | None, float], gaps: dict[int | None, float],
             exact: Callable[[Any], tuple], admits: Callable[[Any], bool]) -> OrderedWalk:
        """Leaves smallest `exact` key first, `exact` pricing never-hit nodes with `priors` and `gaps`
        (writer class -> prior, -> steps to a first hit). `admits(node)`: still a candidate (not taken,
        still a leaf). Leaves filed while the walk is open join it (`add`)."""
        self.prepare(now, priors, gaps)
        return OrderedWalk(self, now, exact, admits)


class OrderedWalk:
    """One pass over a `LeafOrder` (see the module); `push` adds a node (a parent that became a leaf)."""

    def __init__(self, order: LeafOrder, now: float, exact: Callable[[Any], tuple],
                 admits: Callable[[Any], bool]) -> None:
        self.order, self.now, self.exact, self.admits = order, now, exact, admits
        self.ready: list[tuple[tuple, Any]] = []  # (exact key, node), as SGLang's eviction heap holds them
        self.pending: dict[int, tuple] = {}  # id -> the key it waits in `ready` with (an older entry is stale)
        self.seen: set[int] = set()  # ids taken into `ready` (and not refused since)
        self.start()
        self.open = True
        self.ref = weakref.ref(self, order.forget)
        order.walks.append(self.ref)

    def start(self) -> None:
        """The frontier at every heap's top. Again after another walk's prepare moved the entries this one
        pointed at: the entries it already took are skipped (`seen`), so the order goes on exactly."""
        order = self.order
        self.frontier = [(order.bound(key, heap[0], self.now), key, 0) for key, heap in order.groups.items() if heap]
        heapq.heapify(self.frontier)
        self.generation = order.generation

    def push(self, node: Any) -> None:
        """Take `node` at its exact key now; again, at its new key, if it is re-filed before it is yielded."""
        if node.id in self.seen and node.id not in self.pending:
            return
        self.seen.add(node.id)
        key = self.pending[node.id] = self.exact(node)
        heapq.heappush(self.ready, (key, node))

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.generation != self.order.generation:
            self.start()
        ready, frontier = self.ready, self.frontier
        while True:
            if ready and (not frontier or ready[0][0] < frontier[0][0]):
                key, node = heapq.heappop(ready)
                if self.pending.get(node.id) is not key:
                    continue  # pushed again since, at a newer key
                del self.pending[node.id]
                if self.admits(node):
                    return node
                self.seen.discard(node.id)  # refused now (locked): a later re-filing may bring it back
                continue
            if not frontier:
                self.close()
                raise StopIteration
            node = self._pull()
            if node is not None:
                return node

    def _pull(self) -> Any:
        """Take the frontier's head. A node filed at it whose statistics still match is at its exact key
        (`filed_key`, no pricing) when the order was last prepared for this walk's step (a walk left open while a
        later step's walk ran prices it: that walk may have moved a leaf past its deadline); without sessions it is
        returned at once when that key is below every bound and every key taken (None: go on)."""
        order, frontier = self.order, self.frontier
        bound, key, i = heapq.heappop(frontier)
        heap = order.groups[key]
        for child in (2 * i + 1, 2 * i + 2):
            if child < len(heap):
                heapq.heappush(frontier, (order.bound(key, heap[child], self.now), key, child))
        entry = heap[i]
        current = order.entries.get(entry[2])
        if current is None or current[1] is not entry or entry[2] in self.seen:
            return None
        node = current[3]
        if not self.admits(node):
            return None
        if current[2] != order.describe(node):
            order.add(node)  # grew since filed: re-filed, and taken at its key by every open walk, this one too
        elif order.sessions or self.now != order.now:  # with sessions, or a later walk filed for a later step
            self.push(node)
        else:
            exact = order.filed_key(key, bound, entry)
            self.seen.add(node.id)
            if (not frontier or exact < frontier[0][0]) and (not self.ready or exact < self.ready[0][0]):
                return node
            self.pending[node.id] = exact  # not below every bound yet, or a tie the ready heap breaks by node
            heapq.heappush(self.ready, (exact, node))
        return None

    def close(self) -> None:
        """Done with the walk (also when it ran out): entries filed from now on go straight to their heaps."""
        if self.open:
            self.open = False
            self.order.forget(self.ref)
            if not self.order.open_walks:
                self.order.flush()  # what was filed during the walk, so the next one starts with it in place
                self.order.drop_dead_tops()
