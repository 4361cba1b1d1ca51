"""The `sglang.srt.plugins` entry point: SGLang calls `register()` in every process it starts.

Installing vamp-sglang must not change a plain `python -m sglang.launch_server`, so `register()`
does nothing unless our launcher exported VAMP's settings. When it did, each process takes only the
part it needs: scheduler processes (which have imported SGLang's scheduler module by the time
plugins load) get the scheduler hooks, the HTTP process gets the `/vamp/stats` route, and the
detokenizer gets nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from vamp_sglang.config import plugin_enabled
from vamp_sglang.integration.hooks import Hook, register_all, verify_applied

_SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
_HTTP_MODULE = "sglang.srt.entrypoints.http_server"


def all_hooks() -> list[Hook]:
    """Every hook we place in SGLang (the table patches/README.md mirrors)."""
    from vamp_sglang.integration import runtime
    from vamp_sglang.integration.cache import hicache_tier
    from vamp_sglang.integration.decisions import decision_hooks, dp_peers
    from vamp_sglang.integration.memory import expert_memory_hooks, hybrid, weight_updates

    return [_SCHEDULER_INIT, *runtime.HOOKS, *expert_memory_hooks.HOOKS, *decision_hooks.HOOKS, *hybrid.HOOKS,
            *hicache_tier.HOOKS, *dp_peers.HOOKS, *weight_updates.HOOKS]


def scheduler_setups() -> list[Callable[[Any, Any], None]]:
    """Per-scheduler set-up steps run once the scheduler and its VampRuntime exist."""
    from vamp_sglang.integration.cache import hicache_tier, radix_backend
    from vamp_sglang.integration.decisions import decision_hooks
    from vamp_sglang.integration.memory import expert_memory_hooks, hybrid

    # Order matters: the decision maker needs the tree's step source, the expert memory and HiCache's host tier
    # (which sizes the experts' host copies); a hybrid configuration VAMP does not support is refused before the
    # expert memory is built.
    return [radix_backend.setup_scheduler, hybrid.setup_scheduler, expert_memory_hooks.setup_scheduler,
            hicache_tier.setup_scheduler, decision_hooks.setup_scheduler]


def cpu_hooks() -> list[Hook]:
    """Torch paths for GPU-only call sites (Qwen3-Next's Triton ops, FP8's AMX ops, HiCache's host pool and
    direct transfers), torch_native's MLA dispatch (DeepSeek), the gaps of EP and DP attention on CPU
    (cpu/parallel.py) and EAGLE/NEXTN's draft and verify attention (cpu/speculative.py), placed only in CPU
    mode: GPUs keep their kernels."""
    from vamp_sglang.cpu import fp8, hicache, in_cpu_mode, mla, triton_free

    if not in_cpu_mode():
        return []
    from vamp_sglang.cpu import parallel, speculative  # import SGLang's torch_native (parallel replaces it)

    return [*triton_free.HOOKS, *fp8.HOOKS, *mla.HOOKS, *hicache.HOOKS, *parallel.HOOKS, *speculative.HOOKS]


def verify_hooks() -> None:
    verify_applied(all_hooks() + cpu_hooks())


def _after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """The one place a scheduler is wired: its runtime, then each set-up step in order."""
    from sglang.srt.runtime_context import get_observability, get_parallel

    from vamp_sglang.config import VampConfig
    from vamp_sglang.integration import runtime

    config = VampConfig.from_env()
    assert config is not None, "the plugin registers this hook only when the launcher enabled VAMP"
    verify_hooks()
    from vamp_sglang.controller.groups import sglang_round_group

    state = runtime.attach(scheduler, config, get_parallel().tp_rank, get_observability().enable_metrics,
                           sglang_round_group().dp_rank)
    for setup in scheduler_setups():
        setup(scheduler, state)


_SCHEDULER_INIT = Hook(f"{_SCHEDULER_MODULE}.Scheduler.__init__", "after", _after_scheduler_init,
                       "attach the per-process VAMP runtime once the pool, tree and model exist")


def register() -> None:
    if not plugin_enabled():
        return
    from vamp_sglang.integration.cache import radix_backend

    radix_backend.install()  # registry names: the HTTP process parses --radix-eviction-policy vamp too
    if _SCHEDULER_MODULE in sys.modules:
        register_all(all_hooks() + cpu_hooks())
    if _HTTP_MODULE in sys.modules:
        from vamp_sglang.integration.metrics import stats_route

        stats_route.install()
