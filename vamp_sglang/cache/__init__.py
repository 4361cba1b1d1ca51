"""The value-aware radix cache's logic, kept free of SGLang and torch so it is testable alone.

Per-node reuse statistics (`NodeStats`), the admission ledger behind the observed hit rate and the
observed reuse shares that give each node its r_hit prior (`ReuseShares`), the
eviction order (`CostOrder`: nodes not expected back by lowest p_eff of Eq. 1, then farthest expected next use; priced by C_c of Eq. 2), the read-only walk that predicts what an eviction
would free and cost (`walk`), the order kept between shortfalls (`leaf_order`), what evicting from a hybrid model's cache loses (`hybrid`), and the
histograms `/vamp/stats` reports. The SGLang tree these
run on is built in `vamp_sglang.integration.cache.radix_tree`.
"""

from vamp_sglang.cache.histogram import pow2_histogram
from vamp_sglang.cache.hybrid import HybridTree, tokens_losing_reuse
from vamp_sglang.cache.leaf_order import LeafOrder, OrderedWalk
from vamp_sglang.cache.node_stats import AdmissionLedger, NodeStats
from vamp_sglang.cache.ordering import CostOrder
from vamp_sglang.cache.reuse_share import ReuseShares, writer_class
from vamp_sglang.cache.walk import EvictableTree, EvictionEstimate, estimate, eviction_order

__all__ = [
    "AdmissionLedger", "CostOrder", "EvictableTree", "EvictionEstimate", "HybridTree", "LeafOrder", "NodeStats",
    "OrderedWalk", "ReuseShares", "estimate", "eviction_order", "pow2_histogram", "tokens_losing_reuse",
    "writer_class",
]
