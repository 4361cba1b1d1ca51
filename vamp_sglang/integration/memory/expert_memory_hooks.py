"""The hooks that build a scheduler process's expert memory, in three steps (paper IV-C, IV-D, V-B).

1. after `ModelRunner.initialize` (model loaded, before KV sizing and graph capture): the experts are
   rebuilt over paged memory (`moe_staging.convert_experts`);
2. when SGLang creates the KV buffers (MHA's K/V or MLA's latent buffers, and a hybrid model's state
   pool): they are laid over growable reservations (`kv_pool`, `state_pool`); so are a speculative draft's
   KV pools, built while a draft runner's `alloc_memory_pool` runs (`draft_pools`);
3. `setup_scheduler`, once the scheduler exists: the `ExpertMemory` joins the VampRuntime (its
   `stats()` feed `/vamp/stats`); once the decision layer holds the TP ranks' agreement rounds it
   applies `--vamp-initial-offload-ratio` through `offload_at_start`, agreed like every remap.
And on every forward: staging around each eligible layer's MoE kernel (`moe_staging`).
With `--vamp-max-offload-ratio 0` none of this happens and every hook passes straight through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vamp_sglang.config import VampConfig
from vamp_sglang.integration.hooks import Hook
from vamp_sglang.integration.memory import draft_pools, kv_pool, state_pool
from vamp_sglang.integration.memory.expert_memory import ExpertMemory
from vamp_sglang.integration.memory.kv_pool import GrowablePool
from vamp_sglang.integration.memory.state_pool import GrowableStatePool
from vamp_sglang.integration.staging import expert_order, moe_staging
from vamp_sglang.integration.staging.moe_staging import ModelExperts
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.backend_choice import select_backend

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Process:
    """What this scheduler process built so far (one scheduler, one target model per process)."""

    backend: PageBackend
    experts: ModelExperts
    pool: GrowablePool | None = None
    states: GrowableStatePool | None = None
    memory: ExpertMemory | None = None
    draft_pools: list[GrowablePool] = field(default_factory=list)  # the speculative draft runners' KV pools
    building_draft: bool = False  # a draft runner's alloc_memory_pool is running


_process: _Process | None = None


def current_memory() -> ExpertMemory | None:
    """This process's ExpertMemory, or None when VAMP is off here."""
    return _process.memory if _process is not None else None


def _after_model_runner_initialize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    global _process
    config = VampConfig.from_env()
    if config is None or not config.enabled or runner.is_draft_worker:
        return
    if _process is not None:
        raise RuntimeError("vamp: a second target model in one scheduler process is not supported")
    backend = select_backend(config.page_backend, moe_staging.expert_device(runner.model))
    experts = moe_staging.convert_experts(runner.model, backend, config.max_offload_ratio,
                                           staging_policy=config.staging, expert_order=config.expert_order)
    _process = _Process(backend, experts)
    lay = experts.layout
    logger.info("vamp: experts paged: %d eligible layers x %d groups of %d experts, bound %d groups, "
                "%d bytes per group step, backend %s", len(lay.eligible_layer_ids), lay.groups_per_layer,
                lay.group_experts, lay.bound_groups, lay.bytes_freed_per_group, backend.name)


def _around_create_buffers_normal(original: Callable, pool: Any, *args: Any, **kwargs: Any) -> Any:
    """MHA's `_create_buffers_normal` or MLA's `_create_buffers`; an MLA subclass VAMP cannot grow (DSA,
    FP4) reaching the latter is refused here, by `check_pool`, naming its class."""
    if _process is None or (_process.pool is not None and not _process.building_draft):
        return original(pool, *args, **kwargs)
    if _process.pool is None:
        _process.pool = kv_pool.lay_pool_over_growable(pool, _process.backend, _process.experts.layout)
    else:
        _process.draft_pools.append(draft_pools.lay_draft_pool(pool, _process.pool))
    return None


def _around_alloc_memory_pool(original: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """A draft runner builds its KV pool over the target's allocator: mark the pools it creates as drafts."""
    if _process is None or not runner.is_draft_worker:
        return original(runner, *args, **kwargs)
    _process.building_draft = True
    try:
        result = original(runner, *args, **kwargs)
    finally:
        _process.building_draft = False
    draft_pools.check_laid(getattr(runner, "token_to_kv_pool", None), _process.pool, _process.draft_pools)
    return result


def _after_init_mamba_pool(result: Any, req_to_token_pool: Any, *args: Any, **kwargs: Any) -> None:
    if _process is None or _process.states is not None:
        return
    _process.states = state_pool.lay_state_pool_over_growable(req_to_token_pool, _process.backend,
                                                              _process.experts.layout)


def _before_forward_raw(runner: Any, forward_batch: Any = None, *args: Any, **kwargs: Any) -> None:
    if _process is not None and not runner.is_draft_worker:
        input_ids = getattr(kwargs.get("forward_batch", forward_batch), "input_ids", None)
        _process.experts.engine.begin_forward(None if input_ids is None else int(input_ids.shape[0]))
        expert_order.count_real_rows(_process.experts)


def _around_run_moe_core(original: Callable, layer: Any, *args: Any, **kwargs: Any) -> Any:
    if _process is None:
        return original(layer, *args, **kwargs)
    return moe_staging.run_moe_core_staged(_process.experts, original, layer, *args, **kwargs)


def _around_invoke_fused_moe_kernel(original: Callable, *args: Any, **kwargs: Any) -> Any:
    if _process is None:
        return original(*args, **kwargs)
    return moe_staging.invoke_fused_moe_kernel_staged(_process.experts, original, *args, **kwargs)


def setup_scheduler(scheduler: Any, runtime: Any) -> None:
    """Create this scheduler's ExpertMemory and hand it to the runtime (the initial offload waits for the
    decision layer's agreement rounds: `offload_at_start`)."""
    if _process is None:
        return
    if _process.pool is None:
        built = type(scheduler.token_to_kv_pool_allocator.get_kvcache()).__name__
        raise kv_pool.UnsupportedPoolError(f"vamp: the experts are paged but SGLang built its KV pool ({built}) "
                                           "without MHATokenToKVPool._create_buffers_normal or "
                                           "MLATokenToKVPool._create_buffers: VAMP cannot grow it; run with "
                                           "--vamp-max-offload-ratio 0")
    device = _process.backend.device
    states = _process.states
    if states is not None and scheduler.req_to_token_pool.mamba_pool is not states.mamba_pool:
        raise state_pool.UnsupportedStatePoolError("vamp: the scheduler's state pool is not the one VAMP laid out")
    memory = ExpertMemory(_process.experts, _process.pool, scheduler.token_to_kv_pool_allocator,
                          publish=lambda: kv_pool.publish_pool_size(scheduler),
                          quiesce=(lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else _no_op,
                          states=states, tree_cache=scheduler.tree_cache, draft_pools=_process.draft_pools)
    memory.faults = runtime.faults
    _process.memory = memory
    if _process.experts.residency is not None:  # graph capture's routing is not served traffic
        _process.experts.residency.counts.reset()
    memory.size_snapshots = kv_pool.size_snapshots(scheduler)
    scheduler.vamp_expert_memory = runtime.expert_memory = memory
    runtime.extensions.append(memory)
    if not scheduler.spec_algorithm.is_none():
        runtime.extensions.append(draft_pools.SpeculationStats(scheduler))


def offload_at_start(memory: ExpertMemory, rounds: Any, ratio: float) -> int:
    """`--vamp-initial-offload-ratio`, agreed like every remap (`rounds`, the decision layer's RankRounds,
    once the TP ranks' controller exists): every rank offloads the ratio's groups and grows its pool by
    the smallest gain of any rank, or no rank does (the server then starts without it). Returns the
    KV tokens added."""
    groups = rounds.agree(memory.layout.groups_for_ratio(ratio), purpose="start-offload")
    before = memory.pool_sizes()
    added = rounds.remap(memory.tokens_for(groups), lambda tokens: memory.offload(groups, tokens),
                         lambda: memory.return_to(before), purpose="start-offload") if groups else 0
    logger.log(logging.INFO if added or not groups else logging.WARNING,
               "vamp: KV pool %d tokens (%d at start, up to %d); %d groups offloaded at start (%d asked for)",
               memory.pool_tokens, memory.pool.baseline_tokens, memory.stats()["kv_pool"]["max_tokens"],
               memory.offloaded_groups, groups)
    return added


def _no_op() -> None:
    pass


_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
HOOKS = [
    Hook(f"{_MR}.initialize", "after", _after_model_runner_initialize,
         "page the experts once the model is loaded, before KV sizing and graph capture"),
    Hook(f"{_MR}.alloc_memory_pool", "around", _around_alloc_memory_pool,
         "speculative decoding: the KV pools a draft runner builds over the target's allocator grow with it"),
    Hook("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal", "around",
         _around_create_buffers_normal, "lay the KV buffers over reservations that grow in place"),
    Hook("sglang.srt.mem_cache.memory_pool.MLATokenToKVPool._create_buffers", "around", _around_create_buffers_normal,
         "MLA models: lay the per-layer latent buffers over reservations that grow in place"),
    Hook("sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool._init_mamba_pool", "after", _after_init_mamba_pool,
         "hybrid models: lay the linear-attention state tensors over reservations whose every layer grows in place"),
    Hook(f"{_MR}._forward_raw", "before", _before_forward_raw,
         "pick the step's staging mode from its token count; whole-region steps start staging the first "
         "eligible layer's offloaded experts at forward start"),
    Hook("sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.run_moe_core", "around", _around_run_moe_core,
         "wait for a layer's staged experts and prefetch the next layer's right before its MoE kernel, or "
         "copy only the offloaded experts its router selected, as an eager break of breakable CUDA graphs"),
    Hook("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.invoke_fused_moe_kernel", "around",
         _around_invoke_fused_moe_kernel, "Triton MoE: wait for a layer's staged w2 right before its down GEMM, "
         "so the gate-up GEMM overlaps the w2 copy (an eager break too)"),
]
