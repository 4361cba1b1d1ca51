"""The eviction order of the value-aware tree: nodes not expected back by p_eff (Eq. 1), then farthest next use.

The paper prices fixed-size KV blocks (vLLM, 16 tokens) by C_c = p_eff * (n_tok * t_prefill +
t_overhead) (Eq. 2), and for blocks of one size ordering by C_c is ordering by p_eff. SGLang's radix
nodes vary from one token to thousands, and only leaves can go, so we keep the paper's order in
the form that does not depend on size: C_c per unit of re-prefill work, i.e. p_eff. Ordering by
whole-node C_c would evict many small warm nodes before one large cold one (a 30-token session turn
reused three times, C_c ~ 0.4 * (30 * 15 us + 500 us) = 380 us, before a 300-token one-shot prompt
never reused, C_c ~ 0.15 * (300 * 15 us + 500 us) = 750 us); ordering by C_c per token charges the
per-node t_overhead to small nodes, so the 8-token output leaf SGLang splits off every answer would
shield its 200-token prompt (leaf-only eviction) while warmer, larger nodes go.

Our extension of Eq. 1, for sessions that take turns: p_eff falls with idle time, so where every
session's next turn comes after all the others' (agents and chats served side by side, a pool
smaller than their KV together) the session idle longest, the one needed next, goes first, and an
order by p_eff (like LRU) hits nothing, while the offline optimum keeps a fixed subset of sessions
(docs/evaluation.md, `eval.cachesim`). So each node also gets an expected reuse interval G in steps:
the mean gap of its own uses, (last - created) / hits, or before its first hit the mean steps from
write to first hit of its writer class (cache/reuse_share.py; none where no first hit was seen: a
class never reused is not expected back, whatever its prior says). Until
`1 + EXPECTED_BACK_SLACK` intervals have passed since its last use, a node with r_hit at least
`EXPECTED_MIN_REUSE` is expected back at T = last + G, and those nodes go after every other: the never-hit ones first (KV
a session wrote on its last turn, or a request that missed wrote anew, is less sure to come back than
KV already reused; without this split, a session that missed its prefix evicts the retained
sessions' prefixes for its own), then the hit ones, each farthest T first: Belady's rule on
estimated next uses. A node past that (its reuse did not come when due) or with a smaller r_hit is
ordered by p_eff as before, and goes first (held for an interval, one-shot prompts whose writer class
also writes some reused first turns took the pool from sessions arriving at random, whose overdue KV
went first: `tests/test_cachesim_random_arrivals.py`); ties go to the newest node, so where nothing is known
yet (every p_eff = 0) the oldest KV stays, which holds a stable subset where LRU would cycle.
Request priority (SGLang's) orders before all of this (integration/cache/radix_tree.py). Eviction COSTS
remain Eq. 2's C_c (`cost_s`), summed over the nodes evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from vamp_sglang.cache.node_stats import NodeStats
from vamp_sglang.policy.costs import Coefficients, cached_block_cost_s

# a node stays expected back until 1.5 of its reuse intervals have passed: sessions' gaps vary with the
# other sessions' answers, and one slack for all (0.5 to 1 measured alike in `eval.cachesim`)
EXPECTED_BACK_SLACK = 0.5
# a node is expected back only if its r_hit is at least this: KV its writer class reuses less than one time in ten
# (one-shot prompts) is not held for an interval (`eval.cachesim`, random session arrivals among one-shots)
EXPECTED_MIN_REUSE = 0.1

NOT_EXPECTED, EXPECTED = 0, 1  # the order's first key: nodes not expected back go first
Priority = tuple  # (NOT_EXPECTED, p_eff, -created, last) or (EXPECTED, ever hit, -T, -created)


def reuse_interval_steps(stats: NodeStats, r_hit: float, class_gap_steps: float | None) -> float | None:
    """G: the node's mean gap between uses, or before its first hit its writer class's mean steps to a first
    hit. At least one step. None: the node is not expected back (its r_hit is below `EXPECTED_MIN_REUSE`, or
    it was never hit and its class was never seen reused)."""
    if r_hit < EXPECTED_MIN_REUSE:
        return None
    if stats.hits:
        return max((stats.last_step - stats.created_step) / stats.hits, 1.0)
    return None if class_gap_steps is None else max(class_gap_steps, 1.0)


def expected_back_until(stats: NodeStats, gap_steps: float) -> float:
    """The last step at which a node with reuse interval `gap_steps` is still expected back."""
    return stats.last_step + (1.0 + EXPECTED_BACK_SLACK) * gap_steps


@dataclass(frozen=True)
class CostOrder:
    """C_c and p_eff of a node under the configured coefficients, and SGLang's eviction heap key.

    `prior` is the r_hit prior the tree prices the node with, `class_gap_steps` its writer class's
    mean steps to a first hit (cache/reuse_share.py).
    """

    coefficients: Coefficients

    def cost_s(self, tokens: int, stats: NodeStats, now_step: int, prior: float) -> float:
        """Eq. 2 for one node: what re-prefilling it would cost if it were evicted now."""
        return cached_block_cost_s(tokens, stats.hits, stats.age_steps(now_step), prior, self.coefficients)

    def priority(self, stats: NodeStats, now_step: int, prior: float,
                 class_gap_steps: float | None = None) -> Priority:
        """Smallest first: nodes not expected back by (p_eff of Eq. 1, newest first), then the expected
        ones by farthest next use (the module says why)."""
        # reuse_probability's expression inlined (the same floats; its argument checks hold by construction:
        # NodeStats keeps hits >= 0 and a prior in [0, 1], ages are clamped at 0): it runs per leaf priced
        hits, last, rate = stats.hits, stats.last_step, prior
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"a hit rate must be in [0, 1] (got {rate!r})")
        c = self.coefficients
        r_hit = (hits + rate) / (hits + 1)
        gap = reuse_interval_steps(stats, r_hit, class_gap_steps)
        if gap is not None and now_step <= expected_back_until(stats, gap):
            return (EXPECTED, 1 if hits else 0, -(last + gap), -stats.created_step)
        age = now_step - last if now_step > last else 0
        return (NOT_EXPECTED, c.alpha * r_hit / (1.0 + age / c.tau_steps), -stats.created_step, last)
