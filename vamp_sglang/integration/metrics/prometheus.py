"""`vamp:*` Prometheus series, published from each scheduler process.

SGLang serves `/metrics` in Prometheus multiprocess mode, so any metric created in a scheduler
process appears there; gauges use `mostrecent` so the newest value wins. Every series is a field of
the `/vamp/stats` snapshot, so the two views never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# (series name, help, path into the stats snapshot)
GAUGES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vamp:step", "Scheduler steps (launched batches)", ("step",)),
    ("vamp:kv_pool_tokens", "KV pool size in tokens, grown by offloading experts", ("kv_pool", "tokens")),
    ("vamp:kv_pool_baseline_tokens", "KV pool size at start-up", ("kv_pool", "baseline_tokens")),
    ("vamp:kv_pool_free_tokens", "Free KV slots", ("kv_pool", "free_tokens")),
    ("vamp:radix_cached_tokens", "Tokens held by the radix cache", ("radix", "cached_tokens")),
    ("vamp:radix_evictable_tokens", "Radix-cache tokens that may be evicted", ("radix", "evictable_tokens")),
    ("vamp:radix_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens", ("radix", "hit_rate")),
    ("vamp:radix_open_session_tokens", "Radix-cache tokens an open session holds (--enable-session-radix-cache)",
     ("radix", "open_session_tokens")),
    ("vamp:expert_offload_ratio", "Fraction of eligible experts now offloaded", ("experts", "offload_ratio")),
    ("vamp:reclaimed_bytes", "Expert bytes now serving as KV memory", ("experts", "reclaimed_bytes")),
    ("vamp:staging_wait_seconds_total", "Time MoE layers waited for staged experts", ("staging", "wait_s")),
    ("vamp:staged_bytes_total", "Bytes copied into the staging buffers", ("staging", "bytes")),
    ("vamp:staging_copy_seconds_total", "Time the staging copies took", ("staging", "copy_s")),
    *[(f"vamp:staging_{mode}_{key}_total", f"{what} ({mode} staging steps)", ("staging", "modes", mode, path))
      for mode in ("whole", "routed")
      for key, what, path in (("steps", "Forwards", "steps"), ("bytes", "Bytes staged", "bytes"),
                              ("copy_seconds", "Staging copy time", "copy_s"),
                              ("wait_seconds", "Time MoE layers waited for staged experts", "wait_s"))],
    ("vamp:residency_order_digest", "Digest of the expert order (--vamp-expert-order routing), equal on ranks "
     + "holding the same experts", ("residency", "order_digest")),
    ("vamp:remap_seconds_total", "Time spent remapping pages", ("experts", "remap_s")),
    ("vamp:preemptions_avoided_total", "Decode shortfalls covered without preemption", ("preemptions_avoided",)),
    ("vamp:decision_errors_total", "Shortfalls our decision code failed on (SGLang's eviction covered them)",
     ("decision_errors",)),
    ("vamp:offload_failures_total", "Planned offloads that did not happen (remap failed or a rank was lost)",
     ("failures", "offload")),
    ("vamp:restore_failures_total", "Restore attempts that did not happen", ("failures", "restore")),
    ("vamp:admission_refusals_total", "Admissions that waited because the offload they needed failed",
     ("failures", "admission_refusals")),
    # hybrid models only (absent elsewhere): the linear-attention state pool
    ("vamp:state_pool_slots", "State pool size in slots, grown by offloading experts", ("state_pool", "slots")),
    ("vamp:state_pool_baseline_slots", "State pool size at start-up", ("state_pool", "baseline_slots")),
    ("vamp:state_pool_free_slots", "Free state slots", ("state_pool", "free_slots")),
    ("vamp:state_shortfalls_total", "State-slot shortfalls (decided by VAMP when it is on)", ("state_pool", "shortfalls")),
    ("vamp:states_evicted_total", "Cached states SGLang dropped at state shortfalls", ("state_pool", "states_evicted")),
]


def _lookup(stats: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = stats
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


class VampMetrics:
    """The series for one scheduler process, labelled with its TP rank and its DP rank (under DP attention
    each DP rank has its own pool and decides alone; 0 without data parallelism)."""

    def __init__(self, tp_rank: int, dp_rank: int | None = None) -> None:
        from prometheus_client import Counter, Gauge  # lazy: needs PROMETHEUS_MULTIPROC_DIR set first

        labels = {"tp_rank": str(tp_rank), "dp_rank": str(dp_rank or 0)}
        self._gauges = [
            (Gauge(name, doc, labelnames=list(labels), multiprocess_mode="mostrecent").labels(**labels), path)
            for name, doc, path in GAUGES
        ]
        self._decisions = Counter(
            "vamp:decisions", "VAMP decisions at KV shortfalls, by action", labelnames=[*labels, "action"]
        )
        self._labels = labels
        self._published: dict[str, int] = {}

    def publish(self, stats: Mapping[str, Any]) -> None:
        for gauge, path in self._gauges:
            value = _lookup(stats, path)
            if value is not None:
                gauge.set(value)
        for action, count in stats.get("decisions", {}).items():
            delta = count - self._published.get(action, 0)
            if delta > 0:
                self._decisions.labels(action=action, **self._labels).inc(delta)
                self._published[action] = count
