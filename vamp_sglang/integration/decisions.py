"""The VAMP decision at every KV shortfall (paper section IV-B), inside SGLang's scheduler.

SGLang 0.5.23 funnels every KV shortfall through `BaseTokenToKVPoolAllocator.evict_to_free_tokens`
(prefill allocation, decode allocation, the decode capacity check that decides retraction). There
the exact gap is known, so an AROUND hook builds the planner snapshot from the live tree, the expert
memory and the running batch, asks the planner, and carries the plan out:
- offload: the TP ranks agree on a common token count (controller), every rank remaps exactly that
  many (a transaction) or none, and the allocator grows;
- evict: SGLang's own eviction runs, ordered by C_c through our tree's eviction strategy;
- combined: offload the floor, evict the remainder;
- preempt (decode only): leave the gap, so SGLang's `retract_decode` preempts.
Every rank enters the funnel at the same point with the same arguments (SGLang's scheduling is
replicated), and every input of the plan is replicated or agreed, so ranks decide alike.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import time
from typing import Any

from vamp_sglang.integration import compaction
from vamp_sglang.integration.hooks import Hook
from vamp_sglang.integration.runtime import current
from vamp_sglang.policy import Coefficients, EvictableBlock, OffloadState, PreemptCandidate, Snapshot, plan
from vamp_sglang.policy.calibration import Calibrator
from vamp_sglang.policy.decision_log import DecisionLog

logger = logging.getLogger(__name__)

MAX_EVICTION_CANDIDATES = 256  # nodes handed to the planner, cheapest first
IDLE_RESTORE_POLLS = 10  # fully idle polls (about 1 s each) before experts start coming back
_site: contextvars.ContextVar[tuple[str, Any]] = contextvars.ContextVar("vamp_site", default=("prefill", None))


class DecisionMaker:
    """Plans and carries out the action at each shortfall of one scheduler process."""

    def __init__(self, runtime: Any, memory: Any, controller: Any, top_k: int) -> None:
        self.runtime = runtime
        self.memory = memory
        self.controller = controller
        self.top_k = top_k
        self.config = runtime.config
        self.base_coefficients = Coefficients.from_config(self.config)
        self.calibrator = Calibrator()
        self.log = DecisionLog(path=decision_log_path(self.config.decision_log, controller.rank))
        self.round_id = 0
        self.calm_steps = 0
        self.headroom_tokens = 0  # rank-agreed tokens offload could still add; admission counts them
        self.refresh_headroom()

    # --- inputs ------------------------------------------------------------------------------
    def next_round(self) -> int:
        self.round_id += 1
        return self.round_id

    def refresh_headroom(self) -> None:
        local = self.memory.tokens_for(self.memory.headroom_groups())
        round_id = self.next_round()
        self.headroom_tokens = self.controller.agree_min(round_id, local)
        self.controller.all_ok(round_id, True)

    def coefficients(self) -> Coefficients:
        if not self.config.calibrate:
            return self.base_coefficients
        measured = self.calibrator.apply(self.base_coefficients, self.top_k, self.memory.layout.local_experts)
        if self.controller.world_size == 1:
            return measured
        # Timings differ between ranks and decisions must not, so ranks agree on one t_prefill.
        round_id = self.next_round()
        agreed_ns = self.controller.agree_min(round_id, int(measured.t_prefill_s * 1e9))
        self.controller.all_ok(round_id, True)
        t_prefill_s = agreed_ns / 1e9 if agreed_ns else self.base_coefficients.t_prefill_s
        return dataclasses.replace(measured, t_prefill_s=t_prefill_s)

    def snapshot(self, gap_tokens: int, site: str, batch: Any, tree_cache: Any, coeffs: Coefficients) -> Snapshot:
        """The planner's input; it carries the coefficients in use (measured or configured), so a
        logged snapshot replays to the same plan with `python -m vamp_sglang.policy explain`."""
        from vamp_sglang.integration import radix

        scheduler = self.runtime.scheduler
        running = list(batch.reqs) if batch is not None else list(scheduler.running_batch.reqs)
        budgets = [r.sampling_params.max_new_tokens - len(r.output_ids) for r in running]
        headroom = self.memory.headroom_groups()
        per_group = self.memory.tokens_for(1) if headroom else 0
        return Snapshot(
            site=site,
            gap_tokens=gap_tokens,
            evictable=tuple(EvictableBlock(**c) for c in radix.eviction_candidates(tree_cache, MAX_EVICTION_CANDIDATES)),
            offload=OffloadState(
                headroom_groups=headroom,
                tokens_per_group=per_group,
                shards_per_group=self.memory.layout.group_experts if headroom else 0,
                local_experts=self.memory.layout.local_experts,
                top_k=self.top_k,
                decode_budget_min=max(1, min(budgets, default=1)),
            ),
            preempt=tuple(self._preempt_candidates(running)) if site == "decode" else (),
            observed_hit_rate=self.runtime.radix_stats()["hit_rate"],
            coefficients=coeffs.as_overrides(),
        )

    @staticmethod
    def _preempt_candidates(running: list[Any]) -> list[PreemptCandidate]:
        """Victims in SGLang's retraction order. A retracted request's KV returns to the pool;
        what it must recompute later beyond the cached prefix is its decoded part (n_partial)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        keep_order = ScheduleBatch._get_decode_retraction_order(running)
        victims = [running[i] for i in reversed(keep_order[1:])]  # SGLang always keeps one
        return [PreemptCandidate(partial_tokens=len(r.output_ids),
                                 tokens=max(1, len(r.origin_input_ids) + len(r.output_ids)))
                for r in victims]

    # --- the decision ------------------------------------------------------------------------
    def on_shortfall(self, original: Any, allocator: Any, tree_cache: Any, num_tokens: int) -> Any:
        site, batch = _site.get()
        gap = num_tokens - allocator.available_size()
        if gap <= 0 or site == "retract" or tree_cache is None or not tree_cache.supports_prefix_sharing():
            return original(allocator, tree_cache, num_tokens)
        start = time.perf_counter()
        snapshot = self.snapshot(gap, site, batch, tree_cache, self.coefficients())
        chosen = plan(snapshot, self.base_coefficients, self.config.policy)
        decide_s = time.perf_counter() - start
        added = self.offload(chosen.groups) if chosen.groups else 0
        result = None
        if chosen.action != "preempt":
            result = original(allocator, tree_cache, num_tokens)
        # "partial" (nothing covers the gap: offload all headroom and evict all) counts as combined
        self.runtime.decisions["combined" if chosen.action == "partial" else chosen.action] += 1
        covered = allocator.available_size() >= num_tokens
        if site == "decode" and added and covered and gap > sum(b.tokens for b in snapshot.evictable):
            self.runtime.preemptions_avoided += 1
        self.log.record(step=self.runtime.step, site=site, policy=self.config.policy, snapshot=snapshot,
                        plan=chosen, decide_s=decide_s,
                        outcome={"tokens_added": added, "covered": covered, "pool_tokens": self.memory.pool_tokens})
        if added:
            self.runtime.publish_metrics()
        return result

    def offload(self, groups: int) -> int:
        """Offload `groups` per eligible layer on every rank, or on none. Returns tokens added."""
        added = self._agreed(self.memory.tokens_for(groups),
                             lambda tokens: self.memory.offload(groups, tokens),
                             lambda: self.memory.restore(groups))
        self.refresh_headroom()
        return added

    def _agreed(self, proposal: int, apply: Any, undo: Any) -> int:
        """The controller's pattern: agree on min(proposal), apply it everywhere, undo unless all ok."""
        round_id = self.next_round()
        common = self.controller.agree_min(round_id, proposal)
        ok, applied = True, False
        if common > 0:
            try:
                apply(common)
                applied = True
            except Exception:  # the transaction left this rank as before; the vote tells the others
                logger.exception("vamp: remap round %d failed on this rank; no rank keeps it", round_id)
                ok = False
        if not self.controller.all_ok(round_id, ok):
            if applied:
                undo()
            return 0
        return common

    # --- restore when pressure stays low (the paper leaves this out) -------------------------
    def maybe_restore(self, idle: bool = False) -> None:
        """Give expert memory back once the pool has stayed calm long enough.

        Busy: calm means that even after giving one step back, a quarter of the start-up pool
        would stay free, for `--vamp-restore-after-steps` scheduler steps. Idle (no request at
        all; SGLang polls about once a second): after IDLE_RESTORE_POLLS polls the experts come
        back step by step, the cheapest cached prefixes (by C_c) evicted only as far as the
        smaller pool needs, the rest moved off the tail (compaction) so the cache stays warm.
        """
        if not self.config.restore_after_steps or self.memory.offloaded_groups == 0:
            self.calm_steps = 0
            return
        scheduler = self.runtime.scheduler
        allocator = scheduler.token_to_kv_pool_allocator
        groups = min(self.config.expand_groups, self.memory.offloaded_groups)
        keep_tokens = self.memory.size_after_restore(groups)
        step_tokens = self.memory.pool_tokens - keep_tokens
        calm = idle or allocator.available_size() >= step_tokens + self.runtime.baseline_tokens // 4
        self.calm_steps = self.calm_steps + 1 if calm else 0
        if self.calm_steps < (min(IDLE_RESTORE_POLLS, self.config.restore_after_steps) if idle
                              else self.config.restore_after_steps):
            return
        self.calm_steps = 0  # one attempt per calm period, restored or not
        if idle and self.memory.restorable_groups() < groups:
            used = self.memory.pool_tokens - allocator.available_size()
            if used > keep_tokens:
                from sglang.srt.mem_cache.base_prefix_cache import EvictParams

                scheduler.tree_cache.evict(EvictParams(num_tokens=used - keep_tokens))
            compaction.compact_tail(scheduler.tree_cache, allocator, keep_tokens)
        restorable = groups if self.memory.restorable_groups() >= groups else 0
        if self._agreed(restorable, lambda _: self.memory.restore(groups),
                        lambda: self.memory.offload(groups, self.memory.tokens_for(groups))):
            self.runtime.decisions["restore"] += 1
            self.refresh_headroom()
            self.runtime.publish_metrics()

    def stats(self) -> dict[str, Any]:
        c = self.coefficients() if self.controller.world_size == 1 else self.base_coefficients
        return {
            "recent_decisions": self.log.recent(),
            "coefficients": {**c.as_overrides(), "calibrated": self.config.calibrate},
            "calibration": self.calibrator.stats(),
            "admission_headroom_tokens": self.headroom_tokens,
        }


def decision_log_path(path: str | None, tp_rank: int) -> str | None:
    """Rank 0 writes PATH, rank r > 0 writes PATH.rank<r>: ranks decide alike, and the files show it."""
    return path if path is None or tp_rank == 0 else f"{path}.rank{tp_rank}"


def maker() -> DecisionMaker | None:
    runtime = current()
    return getattr(runtime, "decision_maker", None)


# --- hooks ---------------------------------------------------------------------------------------
def _around_evict_to_free(original: Any, allocator: Any, tree_cache: Any, num_tokens: int) -> Any:
    decider = maker()
    if decider is None:
        return original(allocator, tree_cache, num_tokens)
    return decider.on_shortfall(original, allocator, tree_cache, num_tokens)


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


def _around_available_and_evictable(original: Any, budget: Any) -> int:
    decider = maker()
    return original(budget) + (decider.headroom_tokens if decider is not None else 0)


def _around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    decider = maker()
    if decider is None or not batch.forward_mode.is_extend() or not batch.extend_num_tokens:
        result = original(scheduler, batch, *args, **kwargs)
    else:
        start = time.perf_counter()
        result = original(scheduler, batch, *args, **kwargs)
        decider.calibrator.observe_prefill(int(batch.extend_num_tokens), time.perf_counter() - start)
    if decider is not None:
        decider.maybe_restore()
    return result


def _before_on_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    decider = maker()
    if decider is not None and scheduler.is_fully_idle():
        decider.maybe_restore(idle=True)


_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
HOOKS = [
    Hook("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.evict_to_free_tokens", "around",
         _around_evict_to_free, "the decision point: every KV shortfall, with its exact gap, goes through here"),
    Hook(f"{_BATCH}.prepare_for_extend", "around", _at_site("prefill"),
         "mark prefill allocations (no preemption there: admission promised the space)"),
    Hook(f"{_BATCH}.check_decode_mem", "around", _at_site("decode"),
         "mark the decode capacity check, where a plan may leave the gap so SGLang retracts"),
    Hook(f"{_BATCH}.prepare_for_decode", "around", _at_site("decode"), "mark decode allocations"),
    Hook(f"{_BATCH}.retract_decode", "around", _at_site("retract"),
         "inside retraction the decision is made: plain eviction only"),
    Hook("sglang.srt.mem_cache.prefill_budget.PrefillBudget._available_and_evictable", "around",
         _around_available_and_evictable, "admission sees the rank-agreed headroom offloading can add"),
    Hook("sglang.srt.managers.scheduler.Scheduler.run_batch", "around", _around_run_batch,
         "measure t_prefill from prefill batches; restore experts when pressure stays low"),
    Hook("sglang.srt.managers.scheduler.Scheduler.on_idle", "before", _before_on_idle,
         "restore experts once the server has been idle long enough"),
]


def setup_scheduler(scheduler: Any, runtime: Any) -> None:
    """Build the decision maker once expert memory exists (VAMP on only)."""
    from sglang.srt.runtime_context import get_parallel

    from vamp_sglang.controller import RankController

    memory = getattr(runtime, "expert_memory", None)
    if memory is None:
        return
    parallel = get_parallel()
    controller = RankController.from_env(parallel.tp_rank, parallel.tp_size)
    hf_config = scheduler.model_config.hf_config
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or getattr(hf_config, "top_k", 2))
    runtime.decision_maker = DecisionMaker(runtime, memory, controller, top_k)
    runtime.extensions.append(runtime.decision_maker)
