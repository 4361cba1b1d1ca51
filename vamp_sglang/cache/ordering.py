"""The eviction order of the value-aware tree: lowest reuse probability p_eff (Eq. 1) first.

The paper prices fixed-size KV blocks (vLLM, 16 tokens) by C_c = p_eff * (n_tok * t_prefill +
t_overhead) (Eq. 2), and for blocks of one size ordering by C_c is ordering by p_eff. SGLang's radix
nodes vary from one token to thousands, and only leaves can go, so we keep the paper's order in
the form that does not depend on size: C_c per unit of re-prefill work, i.e. p_eff. Ordering by
whole-node C_c would evict many small warm nodes before one large cold one (a 30-token session turn
reused three times, C_c ~ 0.4 * (30 * 15 us + 500 us) = 380 us, before a 300-token one-shot prompt
never reused, C_c ~ 0.15 * (300 * 15 us + 500 us) = 750 us); ordering by C_c per token charges the
per-node t_overhead to small nodes, so the 8-token output leaf SGLang splits off every answer would
shield its 200-token prompt (leaf-only eviction) while warmer, larger nodes go. Ties go to the
least recently used node, then the oldest, so with no reuse observed (every p_eff = 0) this is
SGLang's LRU. Eviction COSTS remain Eq. 2's C_c (`cost_s`), summed over the nodes evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from vamp_sglang.cache.node_stats import NodeStats
from vamp_sglang.policy.costs import Coefficients, cached_block_cost_s

Priority = tuple[float, int, int]


@dataclass(frozen=True)
class CostOrder:
    """C_c and p_eff of a node under the configured coefficients, and SGLang's eviction heap key.

    `prior` is the r_hit prior the tree prices the node with (cache/reuse_share.py).
    """

    coefficients: Coefficients

    def cost_s(self, tokens: int, stats: NodeStats, now_step: int, prior: float) -> float:
        """Eq. 2 for one node: what re-prefilling it would cost if it were evicted now."""
        return cached_block_cost_s(tokens, stats.hits, stats.age_steps(now_step), prior, self.coefficients)

    def priority(self, stats: NodeStats, now_step: int, prior: float) -> Priority:
        """Smallest first: (p_eff of Eq. 1, last use step, creation step)."""
        # reuse_probability's expression inlined (the same floats; its argument checks hold by construction:
        # NodeStats keeps hits >= 0 and a prior in [0, 1], ages are clamped at 0): it runs per leaf priced
        hits, last, rate = stats.hits, stats.last_step, prior
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"a hit rate must be in [0, 1] (got {rate!r})")
        c = self.coefficients
        age = now_step - last if now_step > last else 0
        return (c.alpha * ((hits + rate) / (hits + 1)) / (1.0 + age / c.tau_steps), last, stats.created_step)
