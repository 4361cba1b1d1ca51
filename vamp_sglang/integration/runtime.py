"""The VAMP state of one SGLang scheduler process, and the hooks that read it.

SGLang runs one scheduler process per TP rank; `plugin.py` attaches a `VampRuntime` to each (after
`Scheduler.__init__`) and wires the parts below into it. Everything VAMP reports comes from here,
in the process that owns the pool, the tree and the experts, never from the launcher's copies of
the settings.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from vamp_sglang.cache import AdmissionLedger
from vamp_sglang.config import VampConfig, fault_spec
from vamp_sglang.faults import Faults
from vamp_sglang.integration.hooks import Hook

if TYPE_CHECKING:
    from vamp_sglang.integration.decisions.shortfall import DecisionMaker
    from vamp_sglang.integration.memory.expert_memory import ExpertMemory
    from vamp_sglang.integration.metrics.prometheus import VampMetrics

ACTIONS = ("offload", "evict", "preempt", "combined", "restore")

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
)


class VampRuntime:
    """Per scheduler process: settings, counters, and the parts later hooks consult."""

    def __init__(self, scheduler: Any, config: VampConfig, tp_rank: int, enable_metrics: bool,
                 dp_rank: int | None = None) -> None:
        self.scheduler = scheduler
        self.config = config
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank  # the DP rank whose pool this process holds (None: no data parallelism)
        self.baseline_tokens = int(scheduler.max_total_num_tokens)
        self.decisions: Counter[str] = Counter({action: 0 for action in ACTIONS})
        self.preemptions_avoided = 0
        self.ledger = AdmissionLedger()  # the one observed prefix-hit rate (Eq. 1); our tree reads it too
        self.started_at = time.monotonic()
        self.extensions: list[Any] = []  # objects with .stats() -> dict merged into the snapshot
        # Set by the set-up steps plugin.py runs, when they apply to this process:
        self.vamp_tree: Any | None = None  # the tree cache, when it is ours (--radix-cache-backend vamp)
        self.expert_memory: ExpertMemory | None = None  # VAMP on only
        self.decision_maker: DecisionMaker | None = None  # VAMP on only
        self.metrics: VampMetrics | None = None
        self.faults = Faults.parse(fault_spec(), seed=None)  # VAMP_SGLANG_FAULT (tests and soak only)
        if enable_metrics:
            from vamp_sglang.integration.metrics.prometheus import VampMetrics

            self.metrics = VampMetrics(tp_rank, dp_rank)

    @property
    def step(self) -> int:
        return int(self.scheduler.forward_ct)

    def kv_pool_stats(self) -> dict[str, int]:
        allocator = self.scheduler.token_to_kv_pool_allocator
        return {
            "baseline_tokens": self.baseline_tokens,
            "tokens": int(allocator.size),
            "free_tokens": int(allocator.available_size()),
        }

    def on_admission(self, req: Any, hit_tokens: int, first: bool) -> None:
        """One admitted request: the hit rate counts it once, at its first admission (a later chunk
        or a retracted request's return is no new hit); our tree counts node hits the same way."""
        requested_tokens = len(req.full_untruncated_fill_ids)
        hit_tokens = min(hit_tokens, requested_tokens)
        if self.vamp_tree is not None:  # our tree records into this same ledger
            from vamp_sglang.integration.cache import radix_backend

            radix_backend.record_admission(self.vamp_tree, req, hit_tokens, requested_tokens, first)
        elif first:
            self.ledger.record(hit_tokens, requested_tokens)
        if self.decision_maker is not None:
            self.decision_maker.measurements.on_admission(req)

    def radix_stats(self) -> dict[str, Any]:
        """Sizes any SGLang tree reports; our tree adds its own section through an extension."""
        tree = self.scheduler.tree_cache
        evictable, protected = int(tree.evictable_size()), int(tree.protected_size())
        return {
            "cached_tokens": evictable + protected,
            "evictable_tokens": evictable,
            "protected_tokens": protected,
            "prompt_tokens": self.ledger.requested_tokens,
            "cached_prompt_tokens": self.ledger.hit_tokens,
            "hit_rate": self.ledger.hit_rate,
        }

    def stats(self) -> dict[str, Any]:
        """The `/vamp/stats` snapshot: counts and sizes only, never prompt text or token ids."""
        snapshot: dict[str, Any] = {
            "enabled": self.config.enabled,
            "policy": self.config.policy,
            "tp_rank": self.tp_rank,
            "dp_rank": self.dp_rank,
            "step": self.step,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "kv_pool": self.kv_pool_stats(),
            "radix": self.radix_stats(),
            "decisions": dict(self.decisions),
            "preemptions_avoided": self.preemptions_avoided,
            "experts": {"offload_ratio": 0.0, "max_offload_ratio": self.config.max_offload_ratio},
        }
        for extension in self.extensions:
            for key, value in extension.stats().items():
                if isinstance(value, dict) and isinstance(snapshot.get(key), dict):
                    snapshot[key].update(value)
                else:
                    snapshot[key] = value
        return snapshot

    def publish_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.publish(self.stats())


_current: VampRuntime | None = None  # one scheduler per process


def runtime_of(scheduler: Any) -> VampRuntime | None:
    return getattr(scheduler, "vamp_runtime", None)


def current() -> VampRuntime | None:
    """This process's runtime, for hooks on objects that do not hold the scheduler."""
    return _current


# --- hooks ---------------------------------------------------------------------------------------
def attach(scheduler: Any, config: VampConfig, tp_rank: int, enable_metrics: bool,
           dp_rank: int | None = None) -> VampRuntime:
    """Create this process's runtime (plugin.py calls this once per scheduler)."""
    global _current
    scheduler.vamp_runtime = _current = VampRuntime(scheduler, config, tp_rank, enable_metrics, dp_rank)
    return _current


def _after_run_batch(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    runtime = runtime_of(scheduler)
    if runtime is not None and runtime.metrics is not None and runtime.step % 8 == 0:
        runtime.publish_metrics()


def _after_internal_state(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    runtime = runtime_of(controller.scheduler)
    if runtime is not None:
        result.internal_state["vamp"] = runtime.stats()
        runtime.publish_metrics()


def _after_prefill_admission(result: Any, adder: Any, req: Any, admission: Any, *args: Any, **kw: Any) -> None:
    if _current is None:
        return
    first = not getattr(req, "vamp_admitted", False)
    req.vamp_admitted = True
    _current.on_admission(req, int(admission.prefix_len), first)


HOOKS = [
    Hook(f"{_SCHEDULER}.run_batch", "after", _after_run_batch,
         "publish vamp:* series as steps (forward_ct) advance"),
    Hook(_INTERNAL_STATE, "after", _after_internal_state,
         "answer /vamp/stats from the live scheduler process"),
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder._commit_prefill_admission", "after",
         _after_prefill_admission, "prefix-cache hit rate and radix node hits, once per admitted request"),
]
