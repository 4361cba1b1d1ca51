"""The VAMP state of one SGLang scheduler process, and the hooks that create and read it.

SGLang runs one scheduler process per TP rank; an AFTER hook on `Scheduler.__init__` attaches a
`VampRuntime` to it. Everything VAMP reports comes from here, in the process that owns the pool,
the tree and the experts, never from the launcher's copies of the settings.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from vamp_sglang.config import VampConfig
from vamp_sglang.integration.hooks import Hook

ACTIONS = ("offload", "evict", "preempt", "combined", "restore")

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
)


class VampRuntime:
    """Per scheduler process: settings, counters, and the parts later hooks consult."""

    def __init__(self, scheduler: Any, config: VampConfig, tp_rank: int, enable_metrics: bool) -> None:
        self.scheduler = scheduler
        self.config = config
        self.tp_rank = tp_rank
        self.baseline_tokens = int(scheduler.max_total_num_tokens)
        self.decisions: Counter[str] = Counter({action: 0 for action in ACTIONS})
        self.preemptions_avoided = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.started_at = time.monotonic()
        self.extensions: list[Any] = []  # objects with .stats() -> dict merged into the snapshot
        self.metrics = None
        if enable_metrics:
            from vamp_sglang.integration.metrics import VampMetrics

            self.metrics = VampMetrics(tp_rank)

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

    def record_admission(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a request once, at its first admission (later chunks are not cache hits)."""
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens

    def radix_stats(self) -> dict[str, Any]:
        """Sizes any SGLang tree reports; our tree adds its own section through an extension."""
        tree = self.scheduler.tree_cache
        evictable, protected = int(tree.evictable_size()), int(tree.protected_size())
        return {
            "cached_tokens": evictable + protected,
            "evictable_tokens": evictable,
            "protected_tokens": protected,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "hit_rate": self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }

    def stats(self) -> dict[str, Any]:
        """The `/vamp/stats` snapshot: counts and sizes only, never prompt text or token ids."""
        snapshot: dict[str, Any] = {
            "enabled": self.config.enabled,
            "policy": self.config.policy,
            "tp_rank": self.tp_rank,
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
def _after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.runtime_context import get_observability, get_parallel

    from vamp_sglang.integration import plugin

    config = VampConfig.from_env()
    assert config is not None, "the plugin registers this hook only when the launcher enabled VAMP"
    plugin.verify_hooks()
    global _current
    scheduler.vamp_runtime = _current = VampRuntime(
        scheduler, config, get_parallel().tp_rank, get_observability().enable_metrics
    )
    for setup in plugin.scheduler_setups():
        setup(scheduler, scheduler.vamp_runtime)


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
    if _current is None or getattr(req, "vamp_admitted", False):
        return
    req.vamp_admitted = True
    _current.record_admission(len(req.origin_input_ids), int(admission.prefix_len))


HOOKS = [
    Hook(f"{_SCHEDULER}.__init__", "after", _after_scheduler_init,
         "attach the per-process VAMP runtime once the pool, tree and model exist"),
    Hook(f"{_SCHEDULER}.run_batch", "after", _after_run_batch,
         "publish vamp:* series as steps (forward_ct) advance"),
    Hook(_INTERNAL_STATE, "after", _after_internal_state,
         "answer /vamp/stats from the live scheduler process"),
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder._commit_prefill_admission", "after",
         _after_prefill_admission, "prefix-cache hit rate: cached / prompt tokens, once per admitted request"),
]
