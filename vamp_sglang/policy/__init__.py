"""The decision core of VAMP (paper section IV-B): the cost model, the gap snapshot and the planner.

Pure Python (no torch, no SGLang), so every decision can be replayed from a logged snapshot with
`python -m vamp_sglang.policy explain`.
"""

from vamp_sglang.policy.costs import (
    Coefficients,
    QueueDelayEstimator,
    cached_block_cost_s,
    combined_cost_s,
    dp_charged_groups,
    offload_cost_s,
    preempt_cost_s,
    reuse_probability,
)
from vamp_sglang.policy.planner import ACTIONS, COST_KEYS, POLICIES, Plan, plan
from vamp_sglang.policy.snapshot import (
    DpStep,
    EvictableBlock,
    OffloadState,
    PreemptCandidate,
    Snapshot,
    SnapshotError,
)

__all__ = [
    "ACTIONS", "COST_KEYS", "POLICIES", "Coefficients", "DpStep", "EvictableBlock", "OffloadState", "Plan",
    "PreemptCandidate", "QueueDelayEstimator", "Snapshot", "SnapshotError", "cached_block_cost_s",
    "combined_cost_s", "dp_charged_groups", "offload_cost_s", "plan", "preempt_cost_s", "reuse_probability",
]
