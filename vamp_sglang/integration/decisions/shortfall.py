"""The VAMP decision at every KV shortfall (paper section IV-B): snapshot, plan, carry it out.

SGLang 0.5.23 funnels every KV shortfall through `BaseTokenToKVPoolAllocator.evict_to_free_tokens`
(prefill allocation, decode allocation, the decode capacity check that decides retraction); the
hook there (decision_hooks.py) hands the exact gap to `DecisionMaker.on_shortfall`, which builds the
planner snapshot from the live tree, the expert memory and the running batch, asks the planner, and
carries the plan out:
- offload: the TP ranks agree on the groups and on a common token count (controller), every rank
  remaps exactly that many (a transaction) or none, and the allocator grows;
- evict: SGLang's own eviction runs, in the order of our tree's eviction strategy (cache/ordering.py);
- combined: offload the floor, evict the remainder;
- preempt (decode only): leave the gap, so SGLang's `retract_decode` preempts.

A shortfall never takes the server down. Whatever fails in our code (snapshot, planning, a remap,
a lost rank, the decision log) falls back to SGLang's own eviction for that shortfall, is logged and
counted. The offload headroom admission counts is made real before a request is admitted
(`grow_for_admission`): if that fails the request stays in the waiting queue, so a prefill
allocation never depends on a remap that may not happen.

Every rank enters the funnel at the same point with the same arguments (SGLang's scheduling is
replicated), every input of a plan is agreed (plan_inputs.py), and each shortfall runs the same
agreement rounds whatever the plan, so ranks decide alike and their rounds stay in step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vamp_sglang.controller.rounds import RankRounds
from vamp_sglang.faults import NONE, Faults
from vamp_sglang.integration.decisions.plan_inputs import PlanInputs
from vamp_sglang.integration.decisions.restore_trigger import RestoreTrigger
from vamp_sglang.integration.decisions.step_measurements import StepMeasurements
from vamp_sglang.policy import Coefficients, OffloadState, PreemptCandidate, Snapshot, plan
from vamp_sglang.policy.decision_log import DecisionLog

logger = logging.getLogger(__name__)


class DecisionMaker:
    """Plans and carries out the action at each shortfall of one scheduler process."""

    def __init__(self, runtime: Any, memory: Any, controller: Any, top_k: int, faults: Faults = NONE) -> None:
        self.runtime = runtime
        self.memory = memory
        self.controller = controller
        self.top_k = top_k
        self.faults = faults
        self.config = runtime.config
        self.log = DecisionLog(path=decision_log_path(self.config.decision_log, controller.rank, runtime.dp_rank))
        self.counts = {"errors": 0, "offload_failures": 0, "admission_offloads": 0, "admission_refusals": 0,
                       "restore_failures": 0, "log_errors": 0}
        self._logged_errors: set[str] = set()
        self.restorer = RestoreTrigger(self)
        # the rounds' back-off counts steps and idle polls: an idle server takes no steps, and a miss
        # just before it went idle must not block its idle restore for good (found by a TP2 soak)
        self.rounds = RankRounds(controller, lambda: runtime.step + self.restorer.idle_polls_total, faults)
        self.base_coefficients = Coefficients.from_config(self.config)  # configured; measured ones replace them
        self.measurements = StepMeasurements(self.config, memory, self.base_coefficients)
        self.inputs = PlanInputs(memory, self.rounds, self.config, self.measurements, self.base_coefficients,
                                 lambda: runtime.step, top_k)
        self.inputs.refresh_view()

    # --- the planner's input -----------------------------------------------------------------------
    def snapshot(self, gap_tokens: int, site: str, batch: Any, tree_cache: Any, coeffs: Coefficients,
                 free_tokens: int, with_evictable: bool = True) -> Snapshot:
        """The planner's input; it carries the coefficients in use (measured or configured), so a
        logged snapshot replays to the same plan with `python -m vamp_sglang.policy explain`."""
        from sglang.srt.environ import envs

        from vamp_sglang.integration.cache import hicache_tier, radix_eviction
        from vamp_sglang.integration.decisions import dp_peers

        victims = self._preempt_candidates(list(batch.reqs), int(tree_cache.token_to_kv_pool_allocator.page_size)) \
            if site == "decode" and batch is not None else []
        buffer_tokens = int(envs.SGLANG_RETRACT_DECODE_STEPS.get())
        evictable = radix_eviction.eviction_candidates(tree_cache, gap_tokens, free_tokens, len(victims) + 1,
                                              buffer_tokens) if with_evictable else []
        view = self.inputs.offer()
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
            tpot_guard_groups=self.inputs.guard_cap_groups(),
            host_load_us_per_token=self.inputs.host_load_us_per_token(hicache_tier.current()),
            host_write_back=bool(getattr(hicache_tier.current(), "write_back", False)),
            dp_step=dp_peers.dp_step(self.memory.offloaded_groups),
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
                            decode_budget_min=max(1, min(budgets, default=1)),
                            accept_length=self.inputs.accept_length(self.runtime.scheduler))

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
    def on_shortfall(self, original: Any, allocator: Any, tree_cache: Any, num_tokens: int, site: str,
                     batch: Any) -> Any:
        """SGLang asks `allocator` to free `num_tokens` at `site` ("prefill", "decode", "retract")."""
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
            snapshot = self.snapshot(gap, site, batch, tree_cache, self.inputs.coefficients(), free, with_evictable)
            chosen = plan(snapshot, self.base_coefficients, self.config.policy)
        except Exception as e:  # noqa: BLE001 - a decision error must never reach SGLang's allocator
            self.decision_error(e, snapshot)
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
        self.record(lambda: self.log.record(
            step=self.runtime.step, site=log_site or site, policy=self.config.policy, snapshot=snapshot,
            plan=chosen, decide_s=decide_s, outcome={"tokens_added": added, "pool_tokens": self.memory.pool_tokens}))
        if added:
            self.runtime.publish_metrics()
        return chosen.action, added

    def decision_error(self, error: Exception, snapshot: Snapshot | None) -> None:
        self.counts["errors"] += 1
        kind = type(error).__name__
        if kind not in self._logged_errors:  # once per kind: a broken input must not flood the log
            self._logged_errors.add(kind)
            logger.exception("vamp: decision failed (%s); SGLang's own eviction covers this shortfall. "
                             "snapshot=%s", kind, None if snapshot is None else snapshot.to_json())

    def record(self, write: Callable[[], Any]) -> None:
        """Write a decision-log entry; a failing write (a full disk, a bad value) is counted and logged
        once, never raised: it runs after the decision's rounds, and must not reach SGLang's allocator."""
        try:
            write()
        except Exception:
            self.counts["log_errors"] += 1
            if self.counts["log_errors"] == 1:
                logger.exception("vamp: writing the decision log failed; decisions go on without it")

    def offload(self, groups: int, to_state: bool = False) -> int:
        """Offload `groups` per eligible layer on every rank, or on none, into the KV pool (or, `to_state`,
        a hybrid model's state pool). Returns the tokens (or state slots) added.

        On several ranks the groups are agreed first, in a round every shortfall runs whatever its
        plan (a rank that planned no offload, or failed to plan, proposes 0), so ranks that somehow
        planned differently still remap alike and keep their rounds in step."""
        purpose = "offload-state" if to_state else "offload"
        groups = self.rounds.agree(groups, purpose=purpose)
        if groups == 0:
            return 0
        memory = self.memory
        gain, grow = (memory.slots_for, memory.offload_state) if to_state else (memory.tokens_for, memory.offload)
        before = memory.pool_sizes()  # an undo returns to exactly this, not to what the groups allow
        try:
            proposal = gain(groups)
        except Exception as e:  # noqa: BLE001 - propose nothing, but still take part in the round
            self.decision_error(e, None)
            proposal = 0
        added = self.rounds.remap(proposal, lambda amount: grow(groups, amount), lambda: memory.return_to(before),
                                  purpose=purpose)
        if added:
            self.inputs.refresh_view()
        else:  # agreed on every rank (the vote), so the back-off is replicated
            self.inputs.back_off_offloads()
        return added

    # --- admission ---------------------------------------------------------------------------------
    def admission_headroom_tokens(self, may_agree: bool = True) -> int:
        """KV tokens offloading may still add for admission: the headroom, capped by the TPOT guard.
        `may_agree` False (stats requests) reads the last agreed cap instead of starting a round."""
        view = self.inputs.offer(may_agree)
        cap = self.inputs.guard_cap_groups(may_agree)
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

    # --- what /vamp/stats shows ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Stats requests are not part of the ranks' replicated schedule: never start a round here."""
        guard = self.measurements.guard
        return {
            "recent_decisions": self.log.recent(),
            "coefficients": {**self.inputs.coefficients(may_agree=False).as_overrides(),
                             "calibrated": self.config.calibrate},
            "calibration": self.measurements.calibrator.stats(),
            "admission_headroom_tokens": self.admission_headroom_tokens(may_agree=False),
            "decision_errors": self.counts["errors"],
            "failures": {"offload": self.counts["offload_failures"], "restore": self.counts["restore_failures"],
                         "admission_refusals": self.counts["admission_refusals"],
                         "decision_log": self.counts["log_errors"],
                         "missed_rounds": self.rounds.missed, "undo": self.rounds.undo_failures,
                         "faults_injected": dict(self.faults.fired)},
            "admission_offloads": self.counts["admission_offloads"],
            "tpot_guard": None if guard is None else {
                **guard.stats(), "cap_groups": self.inputs.guard_cap_groups(may_agree=False)},
        }


def decision_log_path(path: str | None, tp_rank: int, dp_rank: int | None = None) -> str | None:
    """Rank 0 writes PATH, rank r > 0 writes PATH.rank<r>: ranks decide alike, and the files show it. Under DP
    attention `tp_rank` is the attention-TP rank and DP rank d > 0 adds .dp<d>: each DP rank decides alone."""
    if path is None:
        return None
    return path + (f".dp{dp_rank}" if dp_rank else "") + (f".rank{tp_rank}" if tp_rank else "")
