"""The plan inputs every TP rank must hold equal before it plans a shortfall (paper IV-B).

A plan is a pure function of its snapshot, and SGLang's scheduling is replicated, so ranks decide
alike as long as every input that is local is agreed first:
- the offload view: the exact KV tokens 1, 2, ... more groups add (Eq. 3's gain), checked by a
  fingerprint round after start-up and after every remap; ranks whose geometry differs are offered
  only "all the headroom at once", at the agreed minimum of its gain. A view agreed without that
  round's success (a rank missed it, or the rounds were backed off) is agreed again at the first
  decision VIEW_RECHECK_STEPS steps later, so one lost round does not leave VAMP off until a remap;
- the calibrated coefficients t_prefill, c_reload and t_queue (Eqs. 2-4): timings differ by rank, so
  the ranks take the agreed minimum, re-agreed every COEFFICIENT_AGREE_STEPS steps; c_reload the maximum,
  the slowest rank's staging wait per offloaded shard, since the MoE output is all-reduced and every
  rank's step waits for the slowest rank's copy (under EP each rank copies only its own experts);
- the TPOT guard's cap on the groups one decision may offload (its timings are local too), agreed
  each time a decision evaluates it: a cap agreed while decode was fast let offloads go on after it
  slowed, and restores and offloads took turns.
With a speculative draft two inputs change (policy/costs.py): the configured t_prefill prices the draft's extend
too (`draft_prefill_s`, draft KV layers over the target's, read from the pools VAMP laid), and Eq. 3 spreads a
step's staging over the accept length (`accept_length`), SGLang's committed tokens per verify. Neither needs a
round: the accept totals are counted from the replicated verify results on every rank alike
(managers/scheduler_components/batch_result_processor.py:984-991, metrics_reporter.py:543-553).
The headroom is withheld for OFFLOAD_RETRY_STEPS steps after a failed offload (the vote that failed
it was seen by every rank, so the back-off is replicated) and for good once this rank could not
undo a remap (its pool differs from the others').
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Callable
from typing import Any

from vamp_sglang.policy import Coefficients
from vamp_sglang.policy.costs import AcceptLengthEstimator, draft_prefill_s

logger = logging.getLogger(__name__)

OFFLOAD_RETRY_STEPS = 64  # after a failed offload, offer no headroom for this many scheduler steps
COEFFICIENT_AGREE_STEPS = 256  # TP ranks re-agree on measured coefficients this often (in steps)
VIEW_RECHECK_STEPS = 256  # a view agreed without a successful fingerprint round is agreed again this late
SLOWEST_NS = 1 << 53  # rounds agree on a minimum of non-negative ints: c_reload's maximum is this less the min


@dataclasses.dataclass(frozen=True)
class OffloadView:
    """Rank-agreed offload headroom: groups, and the exact KV tokens n more groups add."""

    headroom_groups: int
    tokens_by_groups: tuple[int, ...]

    @property
    def headroom_tokens(self) -> int:
        return self.tokens_by_groups[-1] if self.tokens_by_groups else 0


NO_HEADROOM = OffloadView(0, ())


class PlanInputs:
    """The agreed view, coefficients and guard cap of one scheduler process's decisions."""

    def __init__(self, memory: Any, rounds: Any, config: Any, measurements: Any, base_coefficients: Coefficients,
                 step_fn: Callable[[], int], top_k: int) -> None:
        self.memory = memory
        self.rounds = rounds
        self.config = config
        self.measurements = measurements  # the calibrator and the TPOT guard (step_measurements.py)
        self.step_fn = step_fn  # the scheduler's step counter (replicated)
        self.top_k = top_k
        self.base_coefficients = _with_draft_extend(base_coefficients, memory)  # configured, the draft's share in
        self._accept = AcceptLengthEstimator()
        self.offload_blocked_until_step = 0
        self.view = NO_HEADROOM
        self._view_agreed_at_step: int | None = None  # None: the view's fingerprint round succeeded
        self._agreed: Coefficients | None = None
        self._agreed_at_step = 0
        self._guard_cap: int | None = None  # the guard's cap last agreed by the ranks (several ranks only)
        self._host_load: tuple[int, float | None] | None = None  # (step, agreed us/token) of HiCache's load rate

    def refresh_view(self) -> None:
        """Agree on the exact gain of every number of groups (after start-up and every remap).

        Ranks with equal geometry compute equal gains; a fingerprint round checks that. If they
        differ, only "offload all headroom" is offered, at the agreed minimum of its gain."""
        headroom = self.memory.headroom_groups()
        local = tuple(self.memory.tokens_for(n) for n in range(1, headroom + 1))
        fingerprint = zlib.crc32(repr((headroom, local)).encode()) & 0x7FFFFFFF
        self._view_agreed_at_step = None
        if not self.rounds.all_equal(fingerprint, purpose="view"):
            self._view_agreed_at_step = self.step_fn()  # every rank saw the round fail (or skipped it)
            groups = self.rounds.agree(headroom, purpose="view-groups")
            total = self.rounds.agree(self.memory.tokens_for(groups) if groups else 0, purpose="view-tokens")
            logger.warning("vamp: TP ranks differ in KV gain per expert group; offering only %d groups "
                           "at once (%d tokens)", groups, total)
            self.view = OffloadView(groups, (0,) * (groups - 1) + (total,) if groups else ())
            return
        self.view = OffloadView(headroom, local)

    def back_off_offloads(self) -> None:
        """An offload failed on some rank (every rank saw the vote): offer nothing for a while."""
        self.offload_blocked_until_step = self.step_fn() + OFFLOAD_RETRY_STEPS

    def offer(self, may_agree: bool = True) -> OffloadView:
        """The headroom plans and admission may use now (none for a while after a failed offload or
        a missed agreement round, none at all once this rank could not undo a remap). `may_agree` False
        (a stats request, outside the replicated schedule) never re-agrees a view."""
        stale_since = self._view_agreed_at_step
        if may_agree and stale_since is not None and not self.rounds.blocked \
                and self.step_fn() - stale_since >= VIEW_RECHECK_STEPS:
            self.refresh_view()
        blocked = self.step_fn() < self.offload_blocked_until_step or self.rounds.blocked
        return NO_HEADROOM if blocked or self.rounds.undo_failures else self.view

    def guard_cap_groups(self, may_agree: bool = True) -> int | None:
        """The most groups the TPOT guard lets one decision offload now (None: no guard). Timings differ
        by rank, so several ranks agree on the cap each time it is evaluated (decisions and admission
        reach this at the same points on every rank); `may_agree` False (a stats request, outside the
        replicated schedule) reads the last agreed cap."""
        guard = self.measurements.guard
        if guard is None:
            return None
        headroom = self.view.headroom_groups
        local = next((n for n in range(headroom, 0, -1) if guard.allows_offload(n)), 0)
        if not self.rounds.several:
            return local
        if may_agree:
            self._guard_cap = self.rounds.agree(local, purpose="guard")
        return self._guard_cap

    def host_load_us_per_token(self, tier: Any, may_agree: bool = True) -> float | None:
        """HiCache's measured host-to-device load time per token (integration/cache/hicache_tier.py; None without
        HiCache or before a measurement). On several ranks the agreed minimum, re-agreed every
        COEFFICIENT_AGREE_STEPS steps; a missed round gives None, so evictions are priced as re-prefills."""
        local = None if tier is None or tier.load_s_per_token is None else tier.load_s_per_token * 1e6
        if not self.rounds.several or local is None:
            return local
        step = self.step_fn()
        if may_agree and (self._host_load is None or step - self._host_load[0] >= COEFFICIENT_AGREE_STEPS):
            agreed = self.rounds.agree(max(1, int(local * 1e6)), fallback=0, purpose="host_load")  # picoseconds
            self._host_load = (step, agreed / 1e6 if agreed > 0 else None)
        return None if self._host_load is None else self._host_load[1]

    def accept_length(self, scheduler: Any) -> float:
        """Eq. 3's accept length: SGLang's committed tokens per verify (its lifetime totals plus the window its
        metrics reporter has not logged yet), a moving average over the windows between decisions; 1.0 without
        a draft or before the first verify. No verify commits more than the largest draft width SGLang resolved
        (ServerArgs keeps the raw input, None without the flag; --speculative-adaptive moves the current width
        below it), so a window above it is a flush the totals outgrew."""
        if scheduler.spec_algorithm.is_none():
            return 1.0
        from sglang.srt.runtime_context import max_speculative_num_draft_tokens

        r = scheduler.metrics_reporter
        return self._accept.observe(int(r.spec_total_num_accept_tokens + r.spec_num_accept_tokens),
                                    int(r.spec_total_num_forward_ct + r.spec_num_forward_ct),
                                    most_per_verify=max_speculative_num_draft_tokens())

    def coefficients(self, may_agree: bool = True) -> Coefficients:
        """Measured where measured; on several ranks the agreed minimum, re-agreed every
        COEFFICIENT_AGREE_STEPS steps (timings differ by rank, decisions must not)."""
        if not self.config.calibrate:
            return self.base_coefficients
        if self.rounds.several and not may_agree:
            return self._agreed or self.base_coefficients
        measured = self.measurements.calibrator.apply(self.base_coefficients, self.top_k,
                                                      self.memory.layout.local_experts)
        if not self.rounds.several:
            return measured
        step = self.step_fn()
        if self._agreed is None or step - self._agreed_at_step >= COEFFICIENT_AGREE_STEPS:
            ns = {name: self.rounds.agree(int(getattr(measured, name) * 1e9),  # a missed round: configured
                                          fallback=int(getattr(self.base_coefficients, name) * 1e9), purpose=name)
                  for name in ("t_prefill_s", "t_queue_s")}
            ns["c_reload_s"] = SLOWEST_NS - self.rounds.agree(  # the max as the min of its complement
                SLOWEST_NS - min(int(measured.c_reload_s * 1e9), SLOWEST_NS),
                fallback=SLOWEST_NS - int(self.base_coefficients.c_reload_s * 1e9), purpose="c_reload_s")
            agreed = dataclasses.replace(measured, **{name: v / 1e9 for name, v in ns.items()})
            self._agreed = dataclasses.replace(agreed, t_prefill_s=max(agreed.t_prefill_s, 1e-9))
            self._agreed_at_step = step
        return self._agreed


def _with_draft_extend(base: Coefficients, memory: Any) -> Coefficients:
    """The configured coefficients with t_prefill covering the draft's extend (`draft_prefill_s`): the draft's
    KV layers (every draft pool VAMP laid, integration/memory/draft_pools.py) over the target's."""
    drafts = getattr(memory, "draft_pools", ())
    if not drafts:
        return base
    layers = sum(int(d.pool.layer_num) for d in drafts)
    return dataclasses.replace(base, t_prefill_s=draft_prefill_s(base.t_prefill_s, layers,
                                                                 int(memory.pool.pool.layer_num)))
