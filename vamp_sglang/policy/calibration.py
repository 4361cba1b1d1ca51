"""Online calibration of the device- and load-dependent coefficients (t_prefill, c_reload, t_queue).

The paper set t_prefill = 15 us once for an H100. On another device that number misleads the
planner: on a 2-core CPU a prefill token costs ~160 us, so eviction would look ten times cheaper
than it is and VAMP would hardly ever offload. So we measure both device-dependent inputs from the
server's own work, smoothed, and fall back to the configured values until a measurement exists:

- t_prefill (Eqs. 2, 4): seconds per token of the scheduler's prefill batches.
- c_reload (Eq. 3, via c_eff = c_reload * k / E): what one offloaded shard costs a model step,
  measured as staging wait per step per offloaded shard, turned back into c_reload = c_eff * E / k.
- t_queue (Eq. 4): the delay from a retraction to the request's re-admission, as section V says
  ("updated when a preemption-to-rescheduling delay is observed"), starting at the configured value.

No per-workload tuning: the same smoothing for every workload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vamp_sglang.policy.costs import Coefficients, QueueDelayEstimator

SMOOTHING = 0.2  # weight of each new sample in the moving averages
MIN_PREFILL_TOKENS = 32  # smaller batches are dominated by fixed overhead, not per-token cost


@dataclass
class Calibrator:
    """Moving averages of measured per-token prefill time and per-shard staging cost."""

    t_prefill_s: float | None = None
    c_eff_s: float | None = None
    prefill_samples: int = 0
    staging_samples: int = 0
    queue: QueueDelayEstimator | None = None  # None: t_queue stays as configured

    @classmethod
    def starting_from(cls, base: Coefficients) -> Calibrator:
        return cls(queue=QueueDelayEstimator(base.t_queue_s))

    def observe_queue_delay(self, delay_s: float) -> None:
        if self.queue is not None and delay_s >= 0:
            self.queue.observe(delay_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        self.t_prefill_s = smooth(self.t_prefill_s, seconds / tokens)
        self.prefill_samples += 1

    def observe_staging(self, offloaded_shards: int, wait_s: float) -> None:
        """One model step that staged `offloaded_shards` shards per layer and waited `wait_s`."""
        if offloaded_shards <= 0 or wait_s < 0:
            return
        self.c_eff_s = smooth(self.c_eff_s, wait_s / offloaded_shards)
        self.staging_samples += 1

    def apply(self, base: Coefficients, top_k: int, local_experts: int) -> Coefficients:
        """`base` with the measured values in place of the configured ones, where measured."""
        changes: dict[str, float] = {}
        if self.t_prefill_s is not None:
            changes["t_prefill_s"] = self.t_prefill_s
        if self.c_eff_s is not None and top_k > 0:
            changes["c_reload_s"] = self.c_eff_s * local_experts / top_k
        if self.queue is not None and self.queue.observations:
            changes["t_queue_s"] = self.queue.value_s
        return dataclasses.replace(base, **changes)

    def stats(self) -> dict[str, float | int | None]:
        return {
            "t_prefill_us": None if self.t_prefill_s is None else self.t_prefill_s * 1e6,
            "c_eff_us": None if self.c_eff_s is None else self.c_eff_s * 1e6,
            "prefill_samples": self.prefill_samples,
            "staging_samples": self.staging_samples,
            "t_queue_us": None if self.queue is None else self.queue.value_s * 1e6,
            "queue_samples": 0 if self.queue is None else self.queue.observations,
        }


def smooth(current: float | None, sample: float) -> float:
    """The moving average every online measurement uses (SMOOTHING weight for the newest sample)."""
    return sample if current is None else (1 - SMOOTHING) * current + SMOOTHING * sample
