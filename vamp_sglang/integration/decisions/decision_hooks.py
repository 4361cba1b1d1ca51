"""Where the decision layer meets SGLang's scheduler: thin hooks that find this process's decision maker,
call it, and otherwise leave SGLang's own path alone.

- `evict_to_free_tokens`: every KV shortfall, with its exact gap (shortfall.py decides it);
- `prepare_for_extend` / `check_decode_mem` / `prepare_for_decode` / `retract_decode`: which call
  site a shortfall comes from (a preemption may be planned only at the decode capacity check, and
  inside retraction only plain eviction runs);
- `PrefillBudget.has_capacity` / `check_prefill`: admission may count offload headroom, made real
  before the request is admitted;
- `Scheduler.run_batch` / `on_idle`: the step measurements (step_measurements.py) and the restore
  trigger (restore_trigger.py).
Our bookkeeping never takes the scheduler down: what raises in it is counted as a decision error.
"""

from __future__ import annotations

import contextvars
from typing import Any

from vamp_sglang.integration.decisions.prefill_timing import forward_stream_of
from vamp_sglang.integration.decisions.shortfall import DecisionMaker
from vamp_sglang.integration.hooks import Hook
from vamp_sglang.integration.metrics.served_traffic import health_probe
from vamp_sglang.integration.runtime import current

_site: contextvars.ContextVar[tuple[str, Any]] = contextvars.ContextVar("vamp_site", default=("prefill", None))


def maker() -> DecisionMaker | None:
    runtime = current()
    return runtime.decision_maker if runtime is not None else None


def _around_evict_to_free(original: Any, allocator: Any, tree_cache: Any, num_tokens: int) -> Any:
    decider = maker()
    if decider is None:
        return original(allocator, tree_cache, num_tokens)
    return decider.on_shortfall(original, allocator, tree_cache, num_tokens, *_site.get())


def _at_site(name: str):
    def around(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if _site.get()[0] == "retract":  # the retract loop re-checks capacity: plain eviction there
            return original(batch, *args, **kwargs)
        token = _site.set((name, batch))
        try:
            return original(batch, *args, **kwargs)
        finally:
            _site.reset(token)
    return around


_retract_site = _at_site("retract")


def _around_retract_decode(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    result = _retract_site(original, batch, *args, **kwargs)
    decider = maker()
    if decider is not None:
        decider.measurements.on_retracted(result[0])
    return result


def _around_has_capacity(original: Any, budget: Any) -> bool:
    """Admission may start while only offload headroom has room; `check_prefill` makes it real."""
    if original(budget):
        return True
    decider = maker()
    headroom = decider.admission_headroom_tokens() if decider is not None else 0
    return headroom > 0 and min(budget.remaining_total, budget.remaining_current) + headroom > 0


def _around_check_prefill(original: Any, budget: Any, *args: Any, **kwargs: Any) -> Any:
    """A request that fits only with offload headroom triggers the offload before it is admitted."""
    verdict = original(budget, *args, **kwargs)
    decider = maker()
    if verdict[0] or decider is None:
        return verdict
    short = int(kwargs["total_tokens"]) - int(budget.remaining_total) + 1
    if not 0 < short <= decider.admission_headroom_tokens():
        return verdict
    return original(budget, *args, **kwargs) if decider.grow_for_admission(short) else verdict


def _around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    decider = maker()
    if decider is None:
        return original(scheduler, batch, *args, **kwargs)
    measurements = decider.measurements
    # on a GPU the forward is only launched here: the timers read device events later, recorded on the
    # stream this loop runs the forward on (schedule_stream without overlap)
    stream = forward_stream_of(scheduler)
    decode = batch.forward_mode.is_decode()
    if batch.forward_mode.is_extend() and batch.extend_num_tokens:
        with measurements.prefill_timer.measure(int(batch.extend_num_tokens), stream):
            result = original(scheduler, batch, *args, **kwargs)
    else:
        if decode:
            measurements.before_decode_step()
        result = original(scheduler, batch, *args, **kwargs)
    try:  # our bookkeeping must never take the scheduler down
        measurements.prefills_completed()
        measurements.after_forward(decode, health_probe(batch))
        decider.restorer.maybe_restore()
    except Exception as e:  # noqa: BLE001
        decider.decision_error(e, None)
    return result


def _before_on_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    decider = maker()
    if decider is not None and scheduler.is_fully_idle():
        decider.measurements.idle()
        try:
            decider.restorer.maybe_restore(idle=True)
        except Exception as e:  # noqa: BLE001 - our bookkeeping must never take the scheduler down
            decider.decision_error(e, None)


_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_BUDGET = "sglang.srt.mem_cache.prefill_budget.PrefillBudget"
HOOKS = [
    Hook("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.evict_to_free_tokens", "around",
         _around_evict_to_free, "the decision point: every KV shortfall, with its exact gap, goes through here"),
    Hook(f"{_BATCH}.prepare_for_extend", "around", _at_site("prefill"),
         "mark prefill allocations (no preemption there: admission promised the space)"),
    Hook(f"{_BATCH}.check_decode_mem", "around", _at_site("decode"),
         "mark the decode capacity check, where a plan may leave the gap so SGLang retracts"),
    Hook(f"{_BATCH}.prepare_for_decode", "around", _at_site("decode"), "mark decode allocations"),
    Hook(f"{_BATCH}.retract_decode", "around", _around_retract_decode,
         "inside retraction the decision is made: plain eviction only; note when requests were retracted"),
    Hook(f"{_BUDGET}.has_capacity", "around", _around_has_capacity,
         "admission may proceed on offload headroom alone"),
    Hook(f"{_BUDGET}.check_prefill", "around", _around_check_prefill,
         "a request that fits only with offload headroom gets the offload before it is admitted"),
    Hook("sglang.srt.managers.scheduler.Scheduler.run_batch", "around", _around_run_batch,
         "measure t_prefill and the staging cost; restore experts when pressure stays low"),
    Hook("sglang.srt.managers.scheduler.Scheduler.on_idle", "before", _before_on_idle,
         "restore experts once the server has been idle long enough (wall clock)"),
]


def setup_scheduler(scheduler: Any, runtime: Any) -> None:
    """Build the decision maker once expert memory exists (VAMP on only)."""
    from vamp_sglang.controller import RankController
    from vamp_sglang.controller.groups import sglang_round_group
    from vamp_sglang.integration.decisions import dp_peers
    from vamp_sglang.integration.memory.expert_memory_hooks import offload_at_start

    memory = runtime.expert_memory
    if memory is None:
        return
    group = sglang_round_group()  # the ranks sharing this pool: a DP rank's attention-TP group under DPA
    controller = RankController.from_env(group.rank, group.world_size, group_id=group.group_id)
    hf_config = scheduler.model_config.hf_config
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or getattr(hf_config, "top_k", 2))
    maker = runtime.decision_maker = DecisionMaker(runtime, memory, controller, top_k, runtime.faults)
    if runtime.config.initial_offload_ratio:  # agreed like every remap, so it needs the maker's rounds
        offload_at_start(memory, maker.rounds, runtime.config.initial_offload_ratio)
        maker.inputs.refresh_view()
    runtime.extensions.append(maker)
    dp_peers.watch(lambda: memory.offloaded_groups)  # the MLP-sync column other DP ranks read
