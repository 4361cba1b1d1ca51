"""TPOT guard (`--vamp-tpot-slo-ms`): offload only while decode latency stays inside the operator's SLO.

Why: every decode step stages the whole offloaded region of every eligible layer (paper IV-D), so
each offloaded group adds copy time to the step; the paper measures TPOT +31% at VAMP-15 (VI-B) and
shows an oversized ratio costs TPOT (VI-E). The cost model (Eq. 3) weighs reloads against
re-prefill, but knows no latency target. The guard does:

- measure the decode step time online (an exponentially weighted mean of what the caller times:
  the integration takes the interval from one decode step to the next, prefill chunks in between
  included), which is the TPOT a running request sees;
- measure what staging costs a decode step per offloaded group: the time the step stood waiting
  for its staging copies, over the groups it staged (smoothed the same way; a prior until then).
  Only that is attributed to offloading: a step slowed by a prefill chunk or a bigger batch is not;
- project the TPOT after offloading n more groups as step time + n x cost per group, and allow an
  offload only while that stays under `offload_below` x SLO;
- ask for a restore when the smoothed step time stays above the SLO itself for `patience_steps`
  decode steps in a row while experts are offloaded, and only if the staging cost explains the
  excess (without it the step would be inside the SLO): restoring experts cannot fix a step that
  is slow for another reason, and its evictions would add prefill. The band between the two
  thresholds is the hysteresis that keeps offload and restore from taking turns.

Pure Python (no torch, no SGLang): the integration layer feeds it and asks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class TpotGuardError(ValueError):
    """A bad setting or measurement; the message names it."""


@dataclass
class TpotGuard:
    slo_ms: float  # --vamp-tpot-slo-ms
    smoothing: float = 0.2  # weight of the newest measurement in each moving mean
    patience_steps: int = 16  # decode steps over the SLO, while offloaded, before a restore is wanted
    offload_below: float = 0.9  # an offload must keep the projected TPOT under this fraction of the SLO
    prior_ms_per_group: float | None = None  # staging cost per group before any is measured
    _step_ms: float | None = field(default=None, init=False)
    _ms_per_group: float | None = field(default=None, init=False)
    _over_slo_steps: int = field(default=0, init=False)
    _offloaded_groups: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        _positive("slo_ms", self.slo_ms)
        if not 0.0 < self.smoothing <= 1.0:
            raise TpotGuardError(f"smoothing must be in (0, 1] (got {self.smoothing!r})")
        if not 0.0 < self.offload_below <= 1.0:
            raise TpotGuardError(f"offload_below must be in (0, 1] (got {self.offload_below!r})")
        if not isinstance(self.patience_steps, int) or self.patience_steps < 1:
            raise TpotGuardError(f"patience_steps must be a positive integer (got {self.patience_steps!r})")
        if self.prior_ms_per_group is not None:
            _non_negative("prior_ms_per_group", self.prior_ms_per_group)

    # ---- measurements ------------------------------------------------------------------------------

    def observe_decode_step(self, step_ms: float, offloaded_groups: int) -> None:
        """One decode step took `step_ms` with `offloaded_groups` groups offloaded per eligible layer.
        A change of the boundary restarts the patience count: the new state gets its own chance."""
        _non_negative("step_ms", step_ms)
        if not isinstance(offloaded_groups, int) or offloaded_groups < 0:
            raise TpotGuardError(f"offloaded_groups must be a non-negative integer (got {offloaded_groups!r})")
        if offloaded_groups != self._offloaded_groups:
            self._offloaded_groups, self._over_slo_steps = offloaded_groups, 0
        self._step_ms = self._mean(self._step_ms, step_ms)
        staging_ms = offloaded_groups * (self.ms_per_group or 0.0)
        over = offloaded_groups > 0 and self._step_ms > self.slo_ms >= self._step_ms - staging_ms
        self._over_slo_steps = self._over_slo_steps + 1 if over else 0

    def observe_staging(self, staged_groups: int, staging_ms: float) -> None:
        """One decode step stood `staging_ms` waiting for the staging copies of `staged_groups`
        offloaded groups (per eligible layer; the waits of every eligible layer together)."""
        _non_negative("staging_ms", staging_ms)
        if not isinstance(staged_groups, int) or staged_groups < 1:
            raise TpotGuardError(f"staged_groups must be a positive integer (got {staged_groups!r})")
        self._ms_per_group = self._mean(self._ms_per_group, staging_ms / staged_groups)

    # ---- what the controller asks ------------------------------------------------------------------

    @property
    def step_ms(self) -> float | None:
        """The smoothed decode step time (measured TPOT), or None before the first decode step."""
        return self._step_ms

    @property
    def ms_per_group(self) -> float | None:
        """The smoothed staging cost of one group per decode step (the prior until one is measured)."""
        return self._ms_per_group if self._ms_per_group is not None else self.prior_ms_per_group

    def projected_tpot_ms(self, n_groups: int) -> float | None:
        """TPOT after offloading `n_groups` more: step time + n x cost per group (None: no step seen)."""
        if not isinstance(n_groups, int) or n_groups < 0:
            raise TpotGuardError(f"n_groups must be a non-negative integer (got {n_groups!r})")
        if self._step_ms is None:
            return None
        return self._step_ms + n_groups * (self.ms_per_group or 0.0)

    def allows_offload(self, n_groups: int) -> bool:
        """False when the projected TPOT after offloading `n_groups` more would pass `offload_below` x SLO.
        Before any decode step is measured there is nothing to project from, and an offload is allowed."""
        projected = self.projected_tpot_ms(n_groups)
        return projected is None or projected <= self.offload_below * self.slo_ms

    def wants_restore(self) -> bool:
        """True when the measured TPOT has stayed above the SLO, by no more than the staging cost, for
        `patience_steps` decode steps while experts were offloaded: the caller restores one step of groups (cheapest prefixes evicted only
        as far as needed) and reports it with `restored()`."""
        return self._over_slo_steps >= self.patience_steps

    def restored(self) -> None:
        """The caller restored groups: wait `patience_steps` more before asking again."""
        self._over_slo_steps = 0

    def stats(self) -> dict[str, float | int | None]:
        """For /vamp/stats and the decision log (why an offload was ruled out)."""
        return {"slo_ms": self.slo_ms, "step_ms": _round(self._step_ms), "ms_per_group": _round(self.ms_per_group),
                "over_slo_steps": self._over_slo_steps}

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TpotGuardError(f"{name} must be a positive finite number (got {value!r})")


def _non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TpotGuardError(f"{name} must be a finite number >= 0 (got {value!r})")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
