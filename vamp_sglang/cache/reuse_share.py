"""The prior in Eq. 1's r_hit = (hits + prior) / (hits + 1): the observed reuse share of KV like the node's.

Eq. 1 estimates r_hit per node as (hits + prior) / (hits + 1); the prior is all it has before its
first hit. We used to take the writing request's own prefix-hit rate as that prior, on the reasoning
that a continuation (hit rate ~0.9) writes KV its next turn reuses and a one-shot prompt (hit rate
~0) writes KV nobody asks for. The second half is wrong whenever first turns are followed by second
ones: a session's first turn has hit rate ~0 too, so its KV was priced at p_eff = 0 forever, below
every stale node that had ever been hit, and went first (on the Mooncake trace the simulator showed
VAMP at 0.35-0.83x the offline optimum while LRU matched it: docs/evaluation.md).

So the prior is now MEASURED: tokens written by requests whose hit rate falls in the same quarter of
[0, 1] (the writer's class), and how many of those tokens were later reused (their node's first
admitted hit), give that class's observed reuse share, shrunk towards the tree-wide hit rate by
`PSEUDO_TOKENS` of evidence so a class seen little starts at the rate the paper uses. The writer's
rate still separates classes: where one-shot prompts are never reused their class's share falls to
~0 and they go first, as before; where first turns are continued, theirs is what it is.

Each class's first hits also give its mean steps from write to first hit: the reuse interval a
never-hit node of the class is expected back after (cache/ordering.py).

Published shares and intervals move in steps of 2^(1/8) with hysteresis, so the order kept between
shortfalls (`cache.leaf_order`) re-files a class's nodes rarely, not at every admission. Everything
here counts admissions and inserts, which are the same on every TP rank.
"""

from __future__ import annotations

import math

CLASSES = 4  # writer hit rate in [0, 0.25), [0.25, 0.5), [0.5, 0.75), [0.75, 1]
PSEUDO_TOKENS = 1024  # evidence the tree-wide rate counts as, per class
_STEP_LOG2 = 1.0 / 8  # a published share moves only past 2^(1/8)


def writer_class(writer_rate: float | None) -> int | None:
    """The class of KV written by a request with this prefix-hit rate (None: unknown writer)."""
    if writer_rate is None:
        return None
    return min(int(writer_rate * CLASSES), CLASSES - 1)


class ReuseShares:
    """Per writer class: tokens written, tokens reused, first hits and their steps since the write; the
    published prior and reuse interval of each class."""

    __slots__ = ("first_hit_steps", "first_hits", "published", "published_gaps", "refreshed_at", "reused_tokens",
                 "version", "written_tokens")

    def __init__(self) -> None:
        self.written_tokens = [0] * CLASSES
        self.reused_tokens = [0] * CLASSES
        self.first_hits = [0] * CLASSES  # nodes of the class hit for the first time
        self.first_hit_steps = [0] * CLASSES  # their steps from write to that hit, summed
        self.published: dict[int | None, float] = {}  # class (None: unknown writer) -> prior
        self.published_gaps: dict[int | None, float] = {}  # class -> mean steps to a first hit (absent: none seen)
        self.version = 0  # bumped whenever a published prior or interval moves
        self.refreshed_at: float | None = None  # the tree rate of the last refresh; None: counts moved since

    def wrote(self, writer_rate: float | None, tokens: int) -> None:
        cls = writer_class(writer_rate)
        if cls is not None and tokens > 0:
            self.written_tokens[cls] += tokens
            self.refreshed_at = None

    def reused(self, writer_rate: float | None, tokens: int, steps_since_write: int) -> None:
        """A node of `tokens` written by this writer class `steps_since_write` ago was hit for the first time."""
        cls = writer_class(writer_rate)
        if cls is not None and tokens > 0:
            self.reused_tokens[cls] += tokens
            self.first_hits[cls] += 1
            self.first_hit_steps[cls] += max(steps_since_write, 0)
            self.refreshed_at = None

    def share(self, cls: int | None, tree_rate: float) -> float:
        """The observed share, unquantised: (reused + k * tree rate) / (written + k), in [0, 1]."""
        if cls is None:
            return tree_rate
        reused = min(self.reused_tokens[cls], self.written_tokens[cls])
        return (reused + PSEUDO_TOKENS * tree_rate) / (self.written_tokens[cls] + PSEUDO_TOKENS)

    def refresh(self, tree_rate: float) -> int:
        """Re-publish every class whose share or interval left its bucket; returns `version`."""
        if self.refreshed_at == tree_rate:
            return self.version
        self.refreshed_at = tree_rate
        for cls in (None, *range(CLASSES)):
            share, old = self.share(cls, tree_rate), self.published.get(cls)
            if old is None or _moved(old, share):
                self.published[cls] = share
                self.version += 1
            gap, old_gap = self.steps_to_first_hit(cls), self.published_gaps.get(cls)
            if gap is None and old_gap is not None:
                del self.published_gaps[cls]
                self.version += 1
            elif gap is not None and (old_gap is None or _moved(old_gap, gap)):
                self.published_gaps[cls] = gap
                self.version += 1
        return self.version

    def steps_to_first_hit(self, cls: int | None) -> float | None:
        """The class's mean steps from write to first hit, unquantised. A class (or unknown writer) with none
        seen takes every class's together while it has written less than `PSEUDO_TOKENS`, as its prior leans on
        the tree-wide rate; past that, none seen means its KV is not reused (None, as with no first hit at all)."""
        if cls is not None and self.first_hits[cls]:
            return self.first_hit_steps[cls] / self.first_hits[cls]
        if cls is not None and self.written_tokens[cls] >= PSEUDO_TOKENS:
            return None
        hits = sum(self.first_hits)
        return sum(self.first_hit_steps) / hits if hits else None

    def prior(self, writer_rate: float | None) -> float:
        """The published prior of a node written by a request with `writer_rate` (refresh first)."""
        return self.published[writer_class(writer_rate)]

    def gap_steps(self, writer_rate: float | None) -> float | None:
        """The published mean steps to a first hit of the node's class (None: none seen)."""
        return self.published_gaps.get(writer_class(writer_rate))

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """For /vamp/stats: per class, tokens written and reused, the prior and the reuse interval in use."""
        out = {}
        for cls in range(CLASSES):
            low = cls / CLASSES
            out[f"{low:.2f}-{low + 1 / CLASSES:.2f}"] = {
                "written_tokens": self.written_tokens[cls], "reused_tokens": self.reused_tokens[cls],
                "prior": self.published.get(cls), "steps_to_first_hit": self.published_gaps.get(cls)}
        return out


def _moved(old: float, new: float) -> bool:
    if old <= 0.0 or new <= 0.0:
        return old != new
    return abs(math.log2(new / old)) > _STEP_LOG2
