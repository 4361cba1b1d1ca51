"""The eviction order of the value-aware tree: cheapest re-prefill cost C_c (Eq. 2) per token first.

The paper prices fixed-size KV blocks (vLLM, 16 tokens), so ordering blocks by C_c and by C_c per
token is the same thing. SGLang's radix nodes vary from one token to thousands, and ordering them
by whole-node C_c would prefer many small warm nodes to one large cold one: a 30-token session turn
reused three times (C_c ~ 0.4 * (30 * 15 us + 500 us) = 380 us) would go before a 300-token
one-shot prompt never reused (C_c ~ 0.15 * (300 * 15 us + 500 us) = 750 us), although freeing the
same 300 tokens from session turns costs ten times more. Ordering by C_c / n_tok is the greedy that
minimises the summed C_c of the tokens freed, and reduces to the paper's order for equal sizes.
Ties go to the least recently used node, then the oldest, so with no reuse observed at all
(every C_c = 0) the tree behaves exactly like SGLang's LRU.
"""

from __future__ import annotations

from dataclasses import dataclass

from vamp_sglang.cache.node_stats import NodeStats
from vamp_sglang.policy.costs import Coefficients, cached_block_cost_s

Priority = tuple[float, int, int]


@dataclass(frozen=True)
class CostOrder:
    """C_c of a node under the configured coefficients, and the heap key SGLang's eviction pops by."""

    coefficients: Coefficients

    def cost_s(self, tokens: int, stats: NodeStats, now_step: int, observed_hit_rate: float) -> float:
        """Eq. 2 for one node: what re-prefilling it would cost if it were evicted now."""
        return cached_block_cost_s(tokens, stats.hits, stats.age_steps(now_step), observed_hit_rate,
                                   self.coefficients)

    def priority(self, tokens: int, stats: NodeStats, now_step: int, observed_hit_rate: float) -> Priority:
        """Smallest first: (C_c per token, last use step, creation step)."""
        per_token_s = self.cost_s(tokens, stats, now_step, observed_hit_rate) / max(tokens, 1)
        return (per_token_s, stats.last_step, stats.created_step)
