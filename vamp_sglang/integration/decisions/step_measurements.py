"""What each scheduler step measures for the decisions: the coefficients' inputs and the TPOT guard's.

Paper section V calibrates the cost model online; here each forward feeds
- t_prefill (Eqs. 2, 4): prefill tokens and their time, read where results are ready (prefill_timing.py);
- c_eff (Eq. 3): the staging engine's wait per offloaded shard in the forward that just ran;
- t_queue (Eq. 4): from SGLang's retraction of a request to its re-admission;
- the TPOT guard: the interval from one decode step to the next (prefill chunks in between included),
  and what staging cost that decode step: its wait for the staging copies, per offloaded group.
These are local timings; plan_inputs.py agrees them across ranks before a plan uses them.

The same feeds tell /vamp/stats which forwards were served traffic (metrics/served_traffic.py: not the
warm-up request, not health probes); the measurements above keep every forward.
"""

from __future__ import annotations

import time
from typing import Any

from vamp_sglang.integration.decisions.prefill_timing import PrefillTimer
from vamp_sglang.integration.metrics.served_traffic import ServedTraffic
from vamp_sglang.policy import Coefficients
from vamp_sglang.policy.calibration import Calibrator
from vamp_sglang.policy.tpot_guard import TpotGuard


class StepMeasurements:
    """The calibrator, the prefill timer and the TPOT guard of one scheduler process, and their feeds."""

    def __init__(self, config: Any, memory: Any, base_coefficients: Coefficients,
                 warmup: bool | None = None) -> None:
        """`warmup`: whether SGLang sends its warm-up request (None: read --skip-server-warmup)."""
        self.memory = memory
        self.served = ServedTraffic(memory.experts, server_warms_up() if warmup is None else warmup)
        self.calibrator = Calibrator.starting_from(base_coefficients)
        self.prefill_timer = PrefillTimer(memory.experts.backend.device)  # t_prefill, where results are ready
        self.guard = TpotGuard(config.tpot_slo_ms) if config.tpot_slo_ms else None
        self._staging_wait_seen_s = 0.0  # the staging engine's total wait at the last forward
        self._last_decode_start_s: float | None = None  # TPOT guard: start of the previous decode step
        self._retracted_at: dict[str, float] = {}  # rid -> when SGLang retracted it (t_queue, Eq. 4)

    def prefills_completed(self) -> None:
        """Feed the calibrator every prefill whose device time is known by now."""
        for tokens, seconds in self.prefill_timer.completed():
            self.calibrator.observe_prefill(tokens, seconds)

    def after_forward(self, decode: bool, probe: bool = False) -> None:
        """Staging cost of the forward that just ran: c_eff per offloaded shard (Eq. 3, section V); and,
        for the TPOT guard, what a decode step waited for its copies. Only that wait is attributed to
        offloading (issue 19.11): a baseline of step times taken while nothing was offloaded went stale
        as the batch grew, and charged every slower step to the experts. `probe`: a health probe's forward."""
        self.served.after_forward(probe)
        staging = self.memory.experts.engine.stats()
        wait_s = float(staging.wait_s)
        waited_s, self._staging_wait_seen_s = wait_s - self._staging_wait_seen_s, wait_s
        groups = self.memory.offloaded_groups
        if groups:
            self.calibrator.observe_staging(groups * self.memory.layout.group_experts, waited_s)
            if self.guard is not None and decode:
                self.guard.observe_staging(groups, waited_s * 1e3)

    def before_decode_step(self) -> None:
        """TPOT as a running request sees it, for the guard: the time from one decode step to the next
        (prefill chunks in between included)."""
        now = time.perf_counter()
        if self.guard is not None and self._last_decode_start_s is not None:
            self.guard.observe_decode_step((now - self._last_decode_start_s) * 1e3, self.memory.offloaded_groups)
        self._last_decode_start_s = now

    def idle(self) -> None:
        """An idle poll breaks the chain of decode steps: the next one starts a new interval (and the
        first after a forward ends the warm-up)."""
        self._last_decode_start_s = None
        self.served.idle()

    def on_retracted(self, reqs: list[Any]) -> None:
        now = time.perf_counter()
        for req in reqs:
            self._retracted_at[req.rid] = now

    def on_admission(self, req: Any) -> None:
        """t_queue of Eq. 4: from retraction to re-admission, as section V observes it."""
        retracted_at = self._retracted_at.pop(req.rid, None)
        if retracted_at is not None:
            self.calibrator.observe_queue_delay(time.perf_counter() - retracted_at)


def server_warms_up() -> bool:
    """Whether SGLang's HTTP server sends its warm-up request (http_server._wait_and_warmup)."""
    from sglang.srt.runtime_context import get_serving

    return not get_serving().skip_server_warmup
