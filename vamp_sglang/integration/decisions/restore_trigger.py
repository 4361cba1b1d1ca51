"""When experts come back: after a calm stretch, an idle period, or a TPOT over the SLO (the paper leaves
restoring out; policy/restore.py plans it).

Busy, the trigger runs once per scheduler step and counts calm steps (free rows would still cover
the pool after a restore); idle, it runs once per fully idle poll and reads wall-clock idleness at
polls 1, 2, 4, ... of the idle period (ranks poll in lockstep, so the checks and their agreement
rounds happen at the same polls everywhere). A restore is all or nothing on every rank: the ranks
agree on the groups, each evicts and compacts what the plan says, and the remap round undoes it
everywhere unless every rank shrank its pool.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vamp_sglang.integration.decisions import dp_peers
from vamp_sglang.integration.memory import compaction
from vamp_sglang.policy.restore import IDLE_RESTORE_S, RestoreState, calm, decode_reserve_tokens, plan_restore

logger = logging.getLogger(__name__)


class RestoreTrigger:
    """The idle and calm-step clocks of one scheduler process, and the restore they trigger."""

    def __init__(self, maker: Any) -> None:
        self.maker = maker  # the DecisionMaker: memory, rounds, runtime, log, counts, view
        self.idle_polls_total = 0  # fully idle polls ever (replicated: ranks poll in lockstep)
        self.calm_steps = 0
        self.idle_since: float | None = None  # wall clock (local) when the server last became idle
        self.idle_polls = 0  # fully idle polls since then (replicated)
        self.next_idle_check = 1  # poll count of the next idle check (doubles: 1, 2, 4, ...)

    def maybe_restore(self, idle: bool = False) -> None:
        """Busy: called once per scheduler step. Idle: once per fully idle poll."""
        maker = self.maker
        memory, config, runtime, rounds = maker.memory, maker.config, maker.runtime, maker.rounds
        guard = maker.measurements.guard
        self.idle_polls_total += idle
        if not config.restore_after_steps or memory.offloaded_groups == 0:
            self.calm_steps, self.idle_since = 0, None
            return
        scheduler = runtime.scheduler
        allocator = scheduler.token_to_kv_pool_allocator
        groups = min(config.expand_groups, memory.offloaded_groups)
        keep_tokens = memory.size_after_restore(groups)
        free = int(allocator.available_size())
        idle_s, over_slo = 0.0, False
        if idle:
            now = time.monotonic()
            if self.idle_since is None:
                self.idle_since, self.idle_polls, self.next_idle_check = now, 0, 1
            self.idle_polls += 1
            if rounds.several:  # agree on the idle time, at doubling poll counts
                if self.idle_polls < self.next_idle_check:
                    return
                self.next_idle_check *= 2
            # held even during the rounds' back-off: the doubling poll counts are this check's own
            idle_s = rounds.agree(int((now - self.idle_since) * 1000), despite_backoff=True, purpose="idle") / 1000
            if idle_s < IDLE_RESTORE_S:
                return
        else:
            self.idle_since = None
            self.calm_steps = self.calm_steps + 1 if calm(free, memory.pool_tokens, keep_tokens,
                                                        runtime.baseline_tokens) else 0
            over_slo = guard is not None and guard.wants_restore()
            if rounds.several and guard is not None:  # timings differ by rank: agreed once per patience
                over_slo = runtime.step % guard.patience_steps == 0 and bool(rounds.agree(int(over_slo), purpose="slo"))
            if over_slo:
                guard.restored()  # one attempt, then patience again
            elif self.calm_steps < config.restore_after_steps:
                return
        used_states, keep_states, evictable_states = memory.state_restore_view(groups)
        state = RestoreState(
            idle=idle, idle_s=idle_s, calm_steps=self.calm_steps, tpot_over_slo=not idle and over_slo,
            restore_after_steps=config.restore_after_steps, offloaded_groups=memory.offloaded_groups,
            expand_groups=config.expand_groups, pool_tokens=memory.pool_tokens,
            keep_tokens=keep_tokens, used_tokens=memory.pool_tokens - free,
            evictable_tokens=int(scheduler.tree_cache.evictable_size()), baseline_tokens=runtime.baseline_tokens,
            tail_free=memory.restorable_groups() >= groups,
            can_compact=compaction.tail_is_movable(scheduler.tree_cache, allocator, keep_tokens),
            used_state_slots=used_states, keep_state_slots=keep_states, evictable_states=evictable_states,
            reserve_tokens=running_reserve_tokens(scheduler), peer_offloaded_groups=dp_peers.peer_offloaded_groups())
        chosen = plan_restore(state)
        if not chosen.groups:  # the decision log records attempts only: say why there was none
            logger.debug("vamp: no restore at step %d: %s", runtime.step, chosen.reason)
        self.calm_steps = 0  # one attempt per calm period, restored or not
        proposal = rounds.agree(chosen.groups, purpose="restore")  # go ahead only if every rank can
        if proposal == 0:
            return
        self.next_idle_check = 1  # after an attempt, look again at once: one step at a time
        try:
            if chosen.evict_tokens or chosen.evict_states:
                from sglang.srt.mem_cache.base_prefix_cache import EvictParams

                scheduler.tree_cache.evict(EvictParams(num_tokens=chosen.evict_tokens, mamba_num=chosen.evict_states))
            if chosen.compact:
                _after_the_launched_forward(scheduler)
                compaction.compact_tail(scheduler.tree_cache, allocator, memory.sglang_pools, keep_tokens)
            restorable = groups if memory.restorable_groups() >= groups else 0
        except Exception as e:  # noqa: BLE001 - propose nothing, but still take part in the round
            maker.decision_error(e, None)
            restorable = 0
        before = memory.pool_sizes()
        restored = rounds.remap(restorable, lambda _: memory.restore(groups), lambda: memory.return_to(before),
                                purpose="restore")
        maker.record(lambda: maker.log.record_restore(
            step=runtime.step, state=state, plan=chosen, restored_groups=groups if restored else 0,
            pool_tokens=memory.pool_tokens))
        if restored:
            runtime.decisions["restore"] += 1
            maker.inputs.refresh_view()
            runtime.publish_metrics()
        else:
            maker.counts["restore_failures"] += 1


def _after_the_launched_forward(scheduler: Any) -> None:
    """Order the compaction's row copies after the forward `run_batch` just launched.

    Under the overlap scheduler `run_batch` returns once the forward is launched on `forward_stream`
    (sglang/srt/managers/scheduler.py:4671-4672), and the busy restore runs right after it. A request
    that finished in the batch before may still be in that forward (it was scheduled before its result
    came back) while its nodes are already unlocked, so the forward can still read and write rows the
    compaction moves. The compaction copies run on `schedule_stream`, the stream the event loop runs in;
    making it wait for the forward stream is SGLang's own coarse write-after-read barrier
    (`_apply_war_barrier`, scheduler.py:2023). Without overlap the forward ran on this stream already."""
    if getattr(scheduler, "enable_overlap", False):
        scheduler.schedule_stream.wait_stream(scheduler.forward_stream)


def running_reserve_tokens(scheduler: Any) -> int:
    """Rows a busy restore leaves free for the running batch: SGLang's retraction buffer of
    SGLANG_RETRACT_DECODE_STEPS decode tokens per running request (what `retract_decode` keeps for each
    request it lets run, sglang/srt/managers/schedule_batch.py:2391) plus, with a speculative draft, the
    draft tokens each request's next step allocates (`decode_reserve_tokens`), and, while a prefill is
    chunked, its next chunk (at most `chunked_prefill_size`). Replicated on every rank, as the schedule is."""
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode

    draft = 0 if scheduler.spec_algorithm.is_none() else int(get_alloc_reserve_per_decode())
    decode_tokens = decode_reserve_tokens(len(scheduler.running_batch.reqs),
                                          int(envs.SGLANG_RETRACT_DECODE_STEPS.get()), draft)
    chunked = getattr(scheduler, "chunked_req", None) is not None
    return decode_tokens + (int(scheduler.chunked_prefill_size or 0) if chunked else 0)
