"""The VAMP decision at every KV shortfall (paper section IV-B), inside SGLang's scheduler.

SGLang 0.5.23 funnels every KV shortfall through `BaseTokenToKVPoolAllocator.evict_to_free_tokens`
(prefill allocation, decode allocation, the decode capacity check that decides retraction). There
the exact gap is known, so an AROUND hook builds the planner snapshot from the live tree, the expert
memory and the running batch, asks the planner, and carries the plan out:
- offload: the TP ranks agree on the groups and on a common token count (controller), every rank
  remaps exactly that many (a transaction) or none, and the allocator grows;
- evict: SGLang's own eviction runs, in the p_eff order of our tree's eviction strategy;
- combined: offload the floor, evict the remainder;
- preempt (decode only): leave the gap, so SGLang's `retract_decode` preempts.

A shortfall never takes the server down. Whatever fails in our code (snapshot, planning, a remap,
a lost rank) falls back to SGLang's own eviction for that shortfall, is logged and counted. And the
offload headroom admission counts is made real before a request is admitted: a request that fits
only with it triggers the offload at admission, and if that fails it simply stays in the waiting
queue, so a prefill allocation never depends on a remap that may not happen.

Every rank enters the funnel at the same point with the same arguments (SGLang's scheduling is
replicated), every input of a plan is replicated or agreed (the exact group gains, the calibrated
coefficients, idle time), and each shortfall runs the same agreement rounds whatever the plan, so
ranks decide alike and their round ids never drift apart.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import time
import zlib
from typing import Any

from vamp_sglang.controller.rounds import RankRounds
from vamp_sglang.faults import NONE, Faults
from vamp_sglang.integration import compaction
from vamp_sglang.integration.hooks import Hook
from vamp_sglang.integration.prefill_timing import PrefillTimer
from vamp_sglang.integration.runtime import current
from vamp_sglang.policy import Coefficients, OffloadState, PreemptCandidate, Snapshot, plan
from vamp_sglang.policy.calibration import Calibrator, smooth
from vamp_sglang.policy.decision_log import DecisionLog
from vamp_sglang.policy.restore import IDLE_RESTORE_S, RestoreState, calm, plan_restore
from vamp_sglang.policy.tpot_guard import TpotGuard

logger = logging.getLogger(__name__)

OFFLOAD_RETRY_STEPS = 64  # after a failed offload, offer no headroom for this many scheduler steps
COEFFICIENT_AGREE_STEPS = 256  # TP ranks re-agree on measured coefficients this often (in steps)
_site: contextvars.ContextVar[tuple[str, Any]] = contextvars.ContextVar("vamp_site", default=("prefill", None))


@dataclasses.dataclass(frozen=True)
class OffloadView:
    """Rank-agreed offload headroom: groups, and the exact KV tokens n more groups add."""

    headroom_groups: int
    tokens_by_groups: tuple[int, ...]

    @property
    def headroom_tokens(self) -> int:
        return self.tokens_by_groups[-1] if self.tokens_by_groups else 0


NO_HEADROOM = OffloadView(0, ())


class DecisionMaker:
    """Plans and carries out the action at each shortfall of one scheduler process."""

    def __init__(self, runtime: Any, memory: Any, controller: Any, top_k: int, faults: Faults = NONE) -> None:
        self.runtime = runtime
        self.memory = memory
        self.controller = controller
        self.top_k = top_k
        self.faults = faults
        self.config = runtime.config
        self.base_coefficients = Coefficients.from_config(self.config)
        self.calibrator = Calibrator.starting_from(self.base_coefficients)
        self.log = DecisionLog(path=decision_log_path(self.config.decision_log, controller.rank))
        self.idle_polls_total = 0  # fully idle polls ever (replicated: ranks poll in lockstep)
        # the rounds' back-off counts steps and idle polls: an idle server takes no steps, and a miss
        # just before it went idle must not block its idle restore for good (found by a TP2 soak)
        self.rounds = RankRounds(controller, lambda: runtime.step + self.idle_polls_total, faults)
        self.calm_steps = 0
        self.idle_since: float | None = None  # wall clock (local) when the server last became idle
        self.idle_polls = 0  # fully idle polls since then (replicated: ranks poll in lockstep)
        self.next_idle_check = 1  # poll count of the next idle check (doubles: 1, 2, 4, ...)
        self.offload_blocked_until_step = 0
        self.counts = {"errors": 0, "offload_failures": 0, "admission_offloads": 0, "admission_refusals": 0,
                       "restore_failures": 0}
        self._logged_errors: set[str] = set()
        self._agreed: Coefficients | None = None
        self._agreed_at_step = 0
        self._retracted_at: dict[str, float] = {}  # rid -> when SGLang retracted it (t_queue, Eq. 4)
        self._staging_wait_seen_s = 0.0  # the staging engine's total wait at the last forward
        self.prefill_timer = PrefillTimer(memory.experts.backend.device)  # t_prefill, where results are ready
        self._last_decode_start_s: float | None = None  # TPOT guard: start of the previous decode step
        self._resident_step_ms: float | None = None  # TPOT guard: smoothed step time with nothing offloaded
        self.guard = TpotGuard(self.config.tpot_slo_ms) if self.config.tpot_slo_ms else None
        self._guard_cap: int | None = None  # the guard's cap agreed by the ranks (several ranks only)
        self._guard_cap_at_step = 0
        self.view = NO_HEADROOM
        self.refresh_view()

    # --- inputs ------------------------------------------------------------------------------------
    def refresh_view(self) -> None:
        """Agree on the exact gain of every number of groups (after start-up and every remap).

        Ranks with equal geometry compute equal gains; a fingerprint round checks that. If they
        differ, only "offload all headroom" is offered, at the agreed minimum of its gain."""
        headroom = self.memory.headroom_groups()
        local = tuple(self.memory.tokens_for(n) for n in range(1, headroom + 1))
        fingerprint = zlib.crc32(repr((headroom, local)).encode()) & 0x7FFFFFFF
        if not self.rounds.all_equal(fingerprint):
            groups = self.rounds.agree(headroom)
            total = self.rounds.agree(self.memory.tokens_for(groups) if groups else 0)
            logger.warning("vamp: TP ranks differ in KV gain per expert group; offering only %d groups "
                           "at once (%d tokens)", groups, total)
            self.view = OffloadView(groups, (0,) * (groups - 1) + (total,) if groups else ())
            return
        self.view = OffloadView(headroom, local)

    def offer(self) -> OffloadView:
        """The headroom plans and admission may use now (none for a while after a failed offload or
        a missed agreement round, none at all once this rank could not undo a remap)."""
        blocked = self.runtime.step < self.offload_blocked_until_step or self.rounds.blocked
        return NO_HEADROOM if blocked or self.rounds.undo_failures else self.view

    def guard_cap_groups(self) -> int | None:
        """The most groups the TPOT guard lets one decision offload now (None: no guard). Timings differ
        by rank, so several ranks agree on the cap every COEFFICIENT_AGREE_STEPS steps."""
        if self.guard is None:
            return None
        headroom = self.view.headroom_groups
        local = next((n for n in range(headroom, 0, -1) if self.guard.allows_offload(n)), 0)
        if self.controller.world_size == 1:
            return local
        step = self.runtime.step
        if self._guard_cap is None or step - self._guard_cap_at_step >= COEFFICIENT_AGREE_STEPS:
            self._guard_cap, self._guard_cap_at_step = self.rounds.agree(local), step
        return self._guard_cap

    def coefficients(self) -> Coefficients:
        """Measured where measured; on several ranks the agreed minimum, re-agreed every
        COEFFICIENT_AGREE_STEPS steps (timings differ by rank, decisions must not)."""
        if not self.config.calibrate:
            return self.base_coefficients
        measured = self.calibrator.apply(self.base_coefficients, self.top_k, self.memory.layout.local_experts)
        if self.controller.world_size == 1:
            return measured
        step = self.runtime.step
        if self._agreed is None or step - self._agreed_at_step >= COEFFICIENT_AGREE_STEPS:
            ns = {name: self.rounds.agree(int(getattr(measured, name) * 1e9),  # a missed round: configured
                                          fallback=int(getattr(self.base_coefficients, name) * 1e9))
                  for name in ("t_prefill_s", "c_reload_s", "t_queue_s")}
            self._agreed = dataclasses.replace(measured, **{name: v / 1e9 for name, v in ns.items()})
            self._agreed = dataclasses.replace(self._agreed, t_prefill_s=max(self._agreed.t_prefill_s, 1e-9))
            self._agreed_at_step = step
        return self._agreed

    def snapshot(self, gap_tokens: int, site: str, batch: Any, tree_cache: Any, coeffs: Coefficients,
                 free_tokens: int, with_evictable: bool = True) -> Snapshot:
        """The planner's input; it carries the coefficients in use (measured or configured), so a
        logged snapshot replays to the same plan with `python -m vamp_sglang.policy explain`."""
        from sglang.srt.environ import envs

        from vamp_sglang.integration import radix

        victims = self._preempt_candidates(list(batch.reqs), int(tree_cache.token_to_kv_pool_allocator.page_size)) \
            if site == "decode" and batch is not None else []
        buffer_tokens = int(envs.SGLANG_RETRACT_DECODE_STEPS.get())
        evictable = radix.eviction_candidates(tree_cache, gap_tokens, free_tokens, len(victims) + 1,
                                              buffer_tokens) if with_evictable else []
        view = self.offer()
        return Snapshot(
            site=site,
            gap_tokens=gap_tokens,
            free_tokens=free_tokens,
            evictable=tuple(evictable),
            offload=self.offload_state(view.tokens_by_groups, batch),
            preempt=tuple(victims),
            retract_buffer_tokens=buffer_tokens,
            observed_hit_rate=self.runtime.ledger.hit_rate,
            coefficients=coeffs.as_overrides(),
            tpot_guard_groups=self.guard_cap_groups(),
        )

    def offload_state(self, gains_by_groups: tuple[int, ...], batch: Any) -> OffloadState:
        """The planner's offload input: `gains_by_groups[n - 1]` is what n more groups add (KV tokens, or
        state slots at a state shortfall), rank-agreed; the rest is Eq. 3's geometry and w."""
        # w of Eq. 3: the smallest remaining decode budget among the RUNNING requests (section V);
        # with nothing running yet, the batch being admitted is what will decode next.
        running = list(self.runtime.scheduler.running_batch.reqs) or (list(batch.reqs) if batch is not None else [])
        budgets = [r.sampling_params.max_new_tokens - len(r.output_ids) for r in running]
        return OffloadState(headroom_groups=len(gains_by_groups), tokens_by_groups=gains_by_groups,
                            shards_per_group=self.memory.layout.group_experts if gains_by_groups else 0,
                            local_experts=self.memory.layout.local_experts, top_k=self.top_k,
                            decode_budget_min=max(1, min(budgets, default=1)))

    @staticmethod
    def _preempt_candidates(running: list[Any], page_size: int) -> list[PreemptCandidate]:
        """Victims in SGLang's retraction order (it always keeps one). A retracted request frees its
        rows beyond the cache-protected prefix at once (its prompt nodes are only unlocked) and
        re-prefills exactly those when it returns."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        keep_order = ScheduleBatch._get_decode_retraction_order(running)
        victims = [running[i] for i in reversed(keep_order[1:])]
        out = []
        for r in victims:
            freed = max(int(r.owned_kv_len()) - int(r.kv.cache_protected_len), 0)
            out.append(PreemptCandidate(partial_tokens=freed, tokens=freed,
                                        decode_tokens=page_size if r.kv.kv_committed_len % page_size == 0 else 0))
        return out

    # --- the decision ------------------------------------------------------------------------------
    def on_shortfall(self, original: Any, allocator: Any, tree_cache: Any, num_tokens: int) -> Any:
        site, batch = _site.get()
        if site == "retract" or tree_cache is None or not tree_cache.supports_prefix_sharing():
            return original(allocator, tree_cache, num_tokens)
        need = num_tokens
        if site == "decode" and batch is not None and allocator.page_size > 1:
            # prepare_for_decode over-asks (a page per request); plan only for the pages it needs
            need = min(num_tokens, int(batch.new_tokens_required_next_decode()))
        free = int(allocator.available_size())
        if need - free <= 0:
            return original(allocator, tree_cache, num_tokens)
        action, _ = self.decide(site, need - free, free, batch, tree_cache)
        if action == "preempt":
            return None  # leave the gap: SGLang's retract_decode preempts, as priced
        return original(allocator, tree_cache, num_tokens)

    def decide(self, site: str, gap: int, free: int, batch: Any, tree_cache: Any,
               log_site: str | None = None, with_evictable: bool = True) -> tuple[str, int]:
        """Plan one shortfall and carry out its offload part; returns the plan's action ("error" when
        our code failed: SGLang's own eviction then covers the shortfall) and the tokens offloading added."""
        start = time.perf_counter()
        snapshot = chosen = None
        try:
            snapshot = self.snapshot(gap, site, batch, tree_cache, self.coefficients(), free, with_evictable)
            chosen = plan(snapshot, self.base_coefficients, self.config.policy)
        except Exception as e:  # noqa: BLE001 - a decision error must never reach SGLang's allocator
            self._decision_error(e, snapshot)
        decide_s = time.perf_counter() - start
        groups = chosen.groups if chosen is not None else 0
        added = self.offload(groups)
        if chosen is None:
            return "error", added
        # "partial" (nothing covers the gap: offload all headroom and evict all) counts as combined;
        # at admission only an offload that happened counts (the rest is an admission refusal)
        if log_site != "admission":
            self.runtime.decisions["combined" if chosen.action == "partial" else chosen.action] += 1
        elif added:
            self.runtime.decisions["offload"] += 1
        if groups and not added:
            self.counts["offload_failures"] += 1
        if site == "decode" and added >= gap > sum(b.tokens for b in snapshot.evictable):
            self.runtime.preemptions_avoided += 1  # offload covered what eviction could not
        self.log.record(step=self.runtime.step, site=log_site or site, policy=self.config.policy,
                        snapshot=snapshot, plan=chosen, decide_s=decide_s,
                        outcome={"tokens_added": added, "pool_tokens": self.memory.pool_tokens})
        if added:
            self.runtime.publish_metrics()
        return chosen.action, added

    def _decision_error(self, error: Exception, snapshot: Snapshot | None) -> None:
        self.counts["errors"] += 1
        kind = type(error).__name__
        if kind not in self._logged_errors:  # once per kind: a broken input must not flood the log
            self._logged_errors.add(kind)
            logger.exception("vamp: decision failed (%s); SGLang's own eviction covers this shortfall. "
                             "snapshot=%s", kind, None if snapshot is None else snapshot.to_json())

    def offload(self, groups: int, to_state: bool = False) -> int:
        """Offload `groups` per eligible layer on every rank, or on none, into the KV pool (or, `to_state`,
        a hybrid model's state pool). Returns the tokens (or state slots) added.

        On several ranks the groups are agreed first, in a round every shortfall runs whatever its
        plan (a rank that planned no offload, or failed to plan, proposes 0), so ranks that somehow
        planned differently still remap alike and keep their rounds in step."""
        groups = self.rounds.agree(groups)
        if groups == 0:
            return 0
        memory = self.memory
        gain, grow, undo = ((memory.slots_for, memory.offload_state, memory.undo_state_offload) if to_state
                            else (memory.tokens_for, memory.offload, memory.restore))
        try:
            proposal = gain(groups)
        except Exception as e:  # noqa: BLE001 - propose nothing, but still take part in the round
            self._decision_error(e, None)
            proposal = 0
        added = self.rounds.remap(proposal, lambda amount: grow(groups, amount), lambda: undo(groups))
        if added:
            self.refresh_view()
        else:  # agreed on every rank (the vote), so the back-off is replicated
            self.offload_blocked_until_step = self.runtime.step + OFFLOAD_RETRY_STEPS
        return added

    # --- admission ---------------------------------------------------------------------------------
    def admission_headroom_tokens(self, may_agree: bool = True) -> int:
        """KV tokens offloading may still add for admission: the headroom, capped by the TPOT guard.
        `may_agree` False (stats requests) reads the last agreed cap instead of starting a round."""
        view = self.offer()
        cap = self.guard_cap_groups() if may_agree or self.controller.world_size == 1 else self._guard_cap
        groups = view.headroom_groups if cap is None else min(view.headroom_groups, cap)
        return view.tokens_by_groups[groups - 1] if groups else 0

    def grow_for_admission(self, short_tokens: int) -> bool:
        """A request fits only with offload headroom: offload now, before it is admitted. False
        (the request keeps waiting, untouched) if the offload did not happen."""
        allocator = self.runtime.scheduler.token_to_kv_pool_allocator
        _, added = self.decide("prefill", short_tokens, int(allocator.available_size()), None,
                            self.runtime.scheduler.tree_cache, log_site="admission", with_evictable=False)
        if added >= short_tokens:
            self.counts["admission_offloads"] += 1
            return True
        self.counts["admission_refusals"] += 1
        return False

    # --- calibration inputs ------------------------------------------------------------------------
    def after_forward(self, decode: bool) -> None:
        """Staging cost of the forward that just ran: c_eff per offloaded shard (Eq. 3, section V);
        and, for the TPOT guard, decode step times and the staging copy time per offloaded group."""
        staging = self.memory.experts.engine.stats()
        wait_s = float(staging.wait_s)
        waited_s, self._staging_wait_seen_s = wait_s - self._staging_wait_seen_s, wait_s
        groups = self.memory.offloaded_groups
        if groups:
            self.calibrator.observe_staging(groups * self.memory.layout.group_experts, waited_s)
        if self.guard is not None and decode and groups and self._resident_step_ms is None:
            self.guard.observe_staging(groups, float(staging.step_copy_s) * 1e3)  # until a marginal exists

    def before_decode_step(self) -> None:
        """TPOT as a running request sees it: the time from one decode step to the next (prefill
        chunks in between included), for the guard; an idle poll breaks the chain. The staging cost
        per group the guard projects with is the step time's excess over steps with nothing
        offloaded: copies hidden behind compute cost nothing, and copies that steal compute (the
        host path on few cores) cost what they steal, which the copy time alone does not show."""
        now = time.perf_counter()
        groups = self.memory.offloaded_groups
        if self.guard is not None and self._last_decode_start_s is not None:
            step_ms = (now - self._last_decode_start_s) * 1e3
            self.guard.observe_decode_step(step_ms, groups)
            if groups == 0:
                self._resident_step_ms = smooth(self._resident_step_ms, step_ms)
            elif self._resident_step_ms is not None:
                self.guard.observe_staging(groups, max(step_ms - self._resident_step_ms, 0.0))
        self._last_decode_start_s = now

    def on_retracted(self, reqs: list[Any]) -> None:
        now = time.perf_counter()
        for req in reqs:
            self._retracted_at[req.rid] = now

    def on_admission(self, req: Any) -> None:
        """t_queue of Eq. 4: from retraction to re-admission, as section V observes it."""
        retracted_at = self._retracted_at.pop(req.rid, None)
        if retracted_at is not None:
            self.calibrator.observe_queue_delay(time.perf_counter() - retracted_at)

    # --- restore when pressure stays low (the paper leaves this out) -------------------------------
    def maybe_restore(self, idle: bool = False) -> None:
        """Busy: called once per scheduler step. Idle: once per fully idle poll; the idle time is
        wall clock, checked at polls 1, 2, 4, ... of an idle period (ranks poll in lockstep, so the
        checks, and their agreement rounds, happen at the same polls everywhere)."""
        self.idle_polls_total += idle
        if not self.config.restore_after_steps or self.memory.offloaded_groups == 0:
            self.calm_steps, self.idle_since = 0, None
            return
        scheduler = self.runtime.scheduler
        allocator = scheduler.token_to_kv_pool_allocator
        groups = min(self.config.expand_groups, self.memory.offloaded_groups)
        keep_tokens = self.memory.size_after_restore(groups)
        free = int(allocator.available_size())
        idle_s, over_slo = 0.0, False
        if idle:
            now = time.monotonic()
            if self.idle_since is None:
                self.idle_since, self.idle_polls, self.next_idle_check = now, 0, 1
            self.idle_polls += 1
            if self.controller.world_size > 1:  # agree on the idle time, at doubling poll counts
                if self.idle_polls < self.next_idle_check:
                    return
                self.next_idle_check *= 2
            # held even during the rounds' back-off: the doubling poll counts are this check's own
            idle_s = self.rounds.agree(int((now - self.idle_since) * 1000), despite_backoff=True) / 1000
            if idle_s < IDLE_RESTORE_S:
                return
        else:
            self.idle_since = None
            self.calm_steps = self.calm_steps + 1 if calm(free, self.memory.pool_tokens, keep_tokens,
                                                        self.runtime.baseline_tokens) else 0
            over_slo = self.guard is not None and self.guard.wants_restore()
            if self.controller.world_size > 1 and self.guard is not None:
                over_slo = self.runtime.step % COEFFICIENT_AGREE_STEPS == 0 and bool(self.rounds.agree(int(over_slo)))
            if over_slo:
                self.guard.restored()  # one attempt, then patience again
            elif self.calm_steps < self.config.restore_after_steps:
                return
        used_states, keep_states, evictable_states = self.memory.state_restore_view(groups)
        state = RestoreState(
            idle=idle, idle_s=idle_s, calm_steps=self.calm_steps, tpot_over_slo=not idle and over_slo,
            restore_after_steps=self.config.restore_after_steps, offloaded_groups=self.memory.offloaded_groups,
            expand_groups=self.config.expand_groups, pool_tokens=self.memory.pool_tokens,
            keep_tokens=keep_tokens, used_tokens=self.memory.pool_tokens - free,
            evictable_tokens=int(scheduler.tree_cache.evictable_size()), baseline_tokens=self.runtime.baseline_tokens,
            tail_free=self.memory.restorable_groups() >= groups,
            can_compact=compaction.tail_is_movable(scheduler.tree_cache, allocator, keep_tokens),
            used_state_slots=used_states, keep_state_slots=keep_states, evictable_states=evictable_states)
        chosen = plan_restore(state)
        if not chosen.groups:  # the decision log records attempts only: say why there was none
            logger.debug("vamp: no restore at step %d: %s", self.runtime.step, chosen.reason)
        self.calm_steps = 0  # one attempt per calm period, restored or not
        proposal = self.rounds.agree(chosen.groups)  # go ahead only if every rank can
        if proposal == 0:
            return
        self.next_idle_check = 1  # after an attempt, look again at once: one step at a time
        try:
            if chosen.evict_tokens or chosen.evict_states:
                from sglang.srt.mem_cache.base_prefix_cache import EvictParams

                scheduler.tree_cache.evict(EvictParams(num_tokens=chosen.evict_tokens, mamba_num=chosen.evict_states))
            if chosen.compact:
                compaction.compact_tail(scheduler.tree_cache, allocator, self.memory.pool.pool, keep_tokens)
            restorable = groups if self.memory.restorable_groups() >= groups else 0
        except Exception as e:  # noqa: BLE001 - propose nothing, but still take part in the round
            self._decision_error(e, None)
            restorable = 0
        restored = self.rounds.remap(restorable, lambda _: self.memory.restore(groups), self.memory.undo_restore)
        self.log.record_restore(step=self.runtime.step, state=state, plan=chosen, restored_groups=groups
                                if restored else 0, pool_tokens=self.memory.pool_tokens)
        if restored:
            self.runtime.decisions["restore"] += 1
            self.refresh_view()
            self.runtime.publish_metrics()
        else:
            self.counts["restore_failures"] += 1

    def stats(self) -> dict[str, Any]:
        c = self.coefficients() if self.controller.world_size == 1 else (self._agreed or self.base_coefficients)
        return {
            "recent_decisions": self.log.recent(),
            "coefficients": {**c.as_overrides(), "calibrated": self.config.calibrate},
            "calibration": self.calibrator.stats(),
            "admission_headroom_tokens": self.admission_headroom_tokens(may_agree=False),
            "decision_errors": self.counts["errors"],
            "failures": {"offload": self.counts["offload_failures"], "restore": self.counts["restore_failures"],
                         "admission_refusals": self.counts["admission_refusals"],
                         "missed_rounds": self.rounds.missed, "undo": self.rounds.undo_failures,
                         "faults_injected": dict(self.faults.fired)},
            "admission_offloads": self.counts["admission_offloads"],
            # stats requests are not part of the ranks' replicated schedule: never start a round here
            "tpot_guard": None if self.guard is None else {
                **self.guard.stats(),
                "cap_groups": self.guard_cap_groups() if self.controller.world_size == 1 else self._guard_cap},
        }


def decision_log_path(path: str | None, tp_rank: int) -> str | None:
    """Rank 0 writes PATH, rank r > 0 writes PATH.rank<r>: ranks decide alike, and the files show it."""
    return path if path is None or tp_rank == 0 else f"{path}.rank{tp_rank}"


def maker() -> DecisionMaker | None:
    runtime = current()
    return runtime.decision_maker if runtime is not None else None


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


_retract_site = _at_site("retract")


def _around_retract_decode(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    result = _retract_site(original, batch, *args, **kwargs)
    decider = maker()
    if decider is not None:
        decider.on_retracted(result[0])
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
    # on a GPU the forward is only launched here: the timers read device events later
    stream = getattr(scheduler, "forward_stream", None)
    decode = batch.forward_mode.is_decode()
    if batch.forward_mode.is_extend() and batch.extend_num_tokens:
        with decider.prefill_timer.measure(int(batch.extend_num_tokens), stream):
            result = original(scheduler, batch, *args, **kwargs)
    else:
        if decode:
            decider.before_decode_step()
        result = original(scheduler, batch, *args, **kwargs)
    try:  # our bookkeeping must never take the scheduler down
        for tokens, seconds in decider.prefill_timer.completed():
            decider.calibrator.observe_prefill(tokens, seconds)
        decider.after_forward(decode)
        decider.maybe_restore()
    except Exception as e:  # noqa: BLE001
        decider._decision_error(e, None)
    return result


def _before_on_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    decider = maker()
    if decider is not None and scheduler.is_fully_idle():
        decider._last_decode_start_s = None  # the next decode step starts a new chain
        try:
            decider.maybe_restore(idle=True)
        except Exception as e:  # noqa: BLE001 - our bookkeeping must never take the scheduler down
            decider._decision_error(e, None)


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
    from sglang.srt.runtime_context import get_parallel

    from vamp_sglang.controller import RankController

    memory = runtime.expert_memory
    if memory is None:
        return
    parallel = get_parallel()
    controller = RankController.from_env(parallel.tp_rank, parallel.tp_size)
    hf_config = scheduler.model_config.hf_config
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or getattr(hf_config, "top_k", 2))
    runtime.decision_maker = DecisionMaker(runtime, memory, controller, top_k, runtime.faults)
    runtime.extensions.append(runtime.decision_maker)
