"""The three-way cost model of paper section IV-B, one function per equation, in seconds.

Equation numbers follow the paper's own references in section V: Eq. 1 is the reuse estimate
p_eff, Eq. 2 the cached-block eviction cost C_c, Eq. 3 the expert-offload cost C_e, Eqs. 4/5 the
preemption cost C_p^(1) and C_p, Eq. 6 the combined cost C_b. Every value is an action-comparison
weight, not a measured time (section V), so the functions stay pure arithmetic: no torch, no SGLang.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vamp_sglang.config import VampConfig

_US_PER_S = 1e6
_MS_PER_S = 1e3
MAX_DECODE_HORIZON_STEPS = 64  # upper clamp of w in Eq. 3 (section V)

# VampConfig field -> (Coefficients field, config units per second); divide to get seconds
_CONFIG_FIELDS: dict[str, tuple[str, float]] = {
    "alpha": ("alpha", 1.0),
    "tau_steps": ("tau_steps", 1.0),
    "t_prefill_us": ("t_prefill_s", _US_PER_S),
    "t_sched_us": ("t_sched_s", _US_PER_S),
    "t_queue_us": ("t_queue_s", _US_PER_S),
    "c_reload_ms": ("c_reload_s", _MS_PER_S),
    "expand_groups": ("expand_groups", 1.0),
}
COEFFICIENT_NAMES = tuple(_CONFIG_FIELDS)  # the override keys a snapshot may carry


@dataclass(frozen=True)
class Coefficients:
    """The configured weights of section V, converted to seconds once so the equations stay unit-free."""

    alpha: float = 0.5
    tau_steps: float = 2000.0
    t_prefill_s: float = 15 / _US_PER_S
    t_sched_s: float = 500 / _US_PER_S
    t_queue_s: float = 1000 / _US_PER_S
    c_reload_s: float = 0.63 / _MS_PER_S
    expand_groups: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Coefficients.{f.name} must be a finite number (got {value!r})")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"Coefficients.alpha must be in (0, 1] (got {self.alpha!r})")
        if self.tau_steps <= 0 or self.t_prefill_s <= 0:
            raise ValueError("Coefficients.tau_steps and t_prefill_s must be positive")
        if min(self.t_sched_s, self.t_queue_s, self.c_reload_s) < 0:
            raise ValueError("Coefficients.t_sched_s, t_queue_s and c_reload_s must be >= 0")
        if not isinstance(self.expand_groups, int) or self.expand_groups < 1:
            raise ValueError(f"Coefficients.expand_groups must be an integer >= 1 (got {self.expand_groups!r})")

    @classmethod
    def from_config(cls, cfg: VampConfig) -> Coefficients:
        return cls(**{name: getattr(cfg, key) / per_s for key, (name, per_s) in _CONFIG_FIELDS.items()
                      if name != "expand_groups"}, expand_groups=cfg.expand_groups)

    def as_overrides(self) -> dict[str, float | int]:
        """These coefficients keyed by VampConfig field name and unit: what a decision log records."""
        return {key: getattr(self, name) if name == "expand_groups" else getattr(self, name) * per_s
                for key, (name, per_s) in _CONFIG_FIELDS.items()}

    def with_overrides(self, overrides: Mapping[str, float | int]) -> Coefficients:
        """Replace coefficients by VampConfig field name; validated by VampConfig, whose errors name the flag."""
        unknown = sorted(set(overrides) - set(_CONFIG_FIELDS))
        if unknown:
            raise ValueError(f"unknown coefficient {unknown[0]!r}; expected one of {', '.join(COEFFICIENT_NAMES)}")
        values = {**self.as_overrides(), **overrides}
        cfg = dataclasses.replace(VampConfig(), **values).validate()
        return Coefficients.from_config(cfg)


def reuse_probability(hits: int, age_steps: float, observed_hit_rate: float, c: Coefficients) -> float:
    """Eq. 1: p_eff = alpha * r_hit / (1 + age / tau).

    The paper leaves r_hit loosely defined ("observed prefix reuse"). We estimate it per radix-tree
    node, as the design asks, because one workload mixes prefixes that are reused every turn (a
    session's history) with prefixes that never come back (one-shot prompts); a single global rate
    would price both the same and evict them in recency order, which is what stock LRU already does.
    r_hit = (hits + observed_hit_rate) / (hits + 1): a node never hit starts at the workload's
    observed hit rate (the prior, weight one request), and each admitted request that reused the
    node pulls its estimate towards 1. It never exceeds 1 and never falls below the prior.
    """
    if hits < 0 or age_steps < 0 or not 0.0 <= observed_hit_rate <= 1.0:
        raise ValueError(f"reuse_probability needs hits >= 0, age_steps >= 0 and a hit rate in [0, 1] "
                         f"(got {hits!r}, {age_steps!r}, {observed_hit_rate!r})")
    r_hit = (hits + observed_hit_rate) / (hits + 1)
    return c.alpha * r_hit / (1.0 + age_steps / c.tau_steps)


def cached_block_cost_s(tokens: int, hits: int, age_steps: float, observed_hit_rate: float,
                        c: Coefficients) -> float:
    """Eq. 2: C_c = p_eff * (n_tok * t_prefill + t_overhead).

    t_overhead is t_sched for us: a reused prefix that was evicted costs its re-prefill plus one
    extra scheduling round, the same per-event overhead Eq. 4 charges a preemption.
    """
    if tokens < 0:
        raise ValueError(f"cached_block_cost_s needs tokens >= 0 (got {tokens!r})")
    p_eff = reuse_probability(hits, age_steps, observed_hit_rate, c)
    return p_eff * (tokens * c.t_prefill_s + c.t_sched_s)


def host_copy_block_cost_s(tokens: int, hits: int, age_steps: float, observed_hit_rate: float,
                           load_s_per_token: float, c: Coefficients) -> float:
    """Eq. 2 for a block HiCache holds a host copy of: C_c = p_eff * (n_tok * t_load + t_overhead).

    Its next hit loads the copy (n_tok tokens over the measured host-to-device rate) instead of re-prefilling,
    so t_load per token takes t_prefill's place; the scheduling round stays (docs/hicache.md).
    """
    if tokens < 0 or not (math.isfinite(load_s_per_token) and load_s_per_token > 0):
        raise ValueError(f"host_copy_block_cost_s needs tokens >= 0 and a positive finite load time "
                         f"(got {tokens!r}, {load_s_per_token!r})")
    p_eff = reuse_probability(hits, age_steps, observed_hit_rate, c)
    return p_eff * (tokens * load_s_per_token + c.t_sched_s)


def offload_cost_s(n_groups: int, shards_per_group: int, local_experts: int, top_k: int,
                   decode_budget_min: int, c: Coefficients, accept_length: float = 1.0) -> float:
    """Eq. 3: C_e(n_cand) = min(n_cand, E) * c_eff * w.

    n_cand = shards_per_group * n_groups (shard-equivalents), E = rank-local expert shards per
    layer, c_eff = c_reload * k / E, and w = the smallest remaining decode budget among running
    requests clamped to 1..64 steps: the horizon over which the staging cost is paid before the
    pool could shrink back.

    With speculative decoding a step (the target's verify forward, the one forward that stages: the draft's
    experts stay resident) commits `accept_length` tokens, so the staged bytes are spread over them: the
    per-token cost is c_eff / accept_length, and a budget of w tokens is w / accept_length steps (still at
    least one, at most 64). Without a draft accept_length is 1 and this is the paper's Eq. 3.
    """
    if min(n_groups, shards_per_group) < 0 or local_experts < 1 or top_k < 1:
        raise ValueError(f"offload_cost_s needs n_groups, shards_per_group >= 0 and local_experts, top_k >= 1 "
                         f"(got {n_groups!r}, {shards_per_group!r}, {local_experts!r}, {top_k!r})")
    if not (math.isfinite(accept_length) and accept_length >= 1.0):
        raise ValueError(f"offload_cost_s needs accept_length >= 1 tokens per step (got {accept_length!r})")
    n_cand = n_groups * shards_per_group
    c_eff_s = c.c_reload_s * top_k / local_experts
    w_steps = min(max(decode_budget_min / accept_length, 1), MAX_DECODE_HORIZON_STEPS)
    return min(n_cand, local_experts) * c_eff_s * w_steps


def draft_prefill_s(t_prefill_s: float, draft_layers: int, target_layers: int) -> float:
    """t_prefill of Eqs. 2 and 4 with a speculative draft: t_prefill * (1 + draft layers / target layers).

    Every re-prefill (an evicted prefix's, Eq. 2, or a preempted request's n_partial, Eq. 4) also runs the
    draft's extend over the same tokens: SGLang's EAGLE worker runs the target's prefill and then the draft
    extend in one batch (speculative/eagle_worker_v2.py:1548-1597). The draft's share is priced by its layers
    over the target's (DeepSeek-V3's MTP layer: 1 of 61), for the configured t_prefill only: a measured one
    (timed around that whole batch) already holds it.
    """
    if draft_layers < 0 or target_layers < 1:
        raise ValueError(f"draft_prefill_s needs draft_layers >= 0 and target_layers >= 1 "
                         f"(got {draft_layers!r}, {target_layers!r})")
    return t_prefill_s * (1.0 + draft_layers / target_layers)


def dp_charged_groups(n_groups: int, offloaded_groups: int, peer_offloaded_groups: int) -> int:
    """The n_cand of Eq. 3 under DP attention: only the groups that lengthen the global step.

    Every DP rank joins every MoE layer each step (a rank with no batch runs an idle one), and the step
    ends at the MoE all-reduce, so its staging wait is the slowest rank's: that of the most groups any
    DP rank has offloaded, since each rank stages only its own offloaded experts' shards (the same count
    of shards per group on every rank). Offloading n more groups here raises that most from
    max(own, peers) to max(own + n, peers): the rank pays C_e only for what it adds above the peers,
    max(0, own + n - max(own, peers)), and nothing while it stays at or below the most a peer offloaded.
    With no peer ahead (or without DP attention) this is n, and C_e is Eq. 3 as the paper has it.
    """
    if min(n_groups, offloaded_groups, peer_offloaded_groups) < 0:
        raise ValueError(f"dp_charged_groups needs counts >= 0 (got {n_groups!r}, {offloaded_groups!r}, "
                         f"{peer_offloaded_groups!r})")
    return max(0, offloaded_groups + n_groups - max(offloaded_groups, peer_offloaded_groups))


def preempt_cost_s(partial_tokens_per_victim: Sequence[int], c: Coefficients) -> float:
    """Eqs. 4 and 5: C_p^(1) = t_sched + t_queue + n_partial * t_prefill, C_p = C_p^(1) * G.

    G, which the paper leaves open, is for us the number of victims SGLang must retract to cover
    the gap; each victim has its own n_partial (the tokens it must re-prefill on return), so C_p is
    the sum of the victims' C_p^(1), which equals C_p^(1) * G when their n_partial agree.
    """
    if any(n < 0 for n in partial_tokens_per_victim):
        raise ValueError(f"preempt_cost_s needs partial tokens >= 0 (got {list(partial_tokens_per_victim)!r})")
    return sum(c.t_sched_s + c.t_queue_s + n * c.t_prefill_s for n in partial_tokens_per_victim)


def combined_cost_s(offload_floor_cost_s: float, evict_remainder_cost_s: float) -> float:
    """Eq. 6: C_b = C_e^floor + C_c^remainder.

    The floor is the largest allowed offload (expand steps, capped at the headroom) that stays
    below the gap; the remainder is evicted cheapest-C_c first. The planner picks both; this is the sum.
    """
    return offload_floor_cost_s + evict_remainder_cost_s


class QueueDelayEstimator:
    """t_queue of Eq. 4: starts at the configured value (1,000 us) and follows observed delays.

    Section V updates t_queue "when a preemption-to-rescheduling delay is observed"; an
    exponential moving average keeps one slow reschedule from dominating the next decisions.
    """

    EMA_WEIGHT = 0.2  # weight of the newest observation

    def __init__(self, initial_s: float) -> None:
        if not (math.isfinite(initial_s) and initial_s >= 0):
            raise ValueError(f"QueueDelayEstimator needs a finite initial delay >= 0 (got {initial_s!r})")
        self._value_s = initial_s
        self.observations = 0

    @property
    def value_s(self) -> float:
        return self._value_s

    def observe(self, delay_s: float) -> float:
        """Fold in one preemption-to-reschedule delay (seconds); returns the new estimate."""
        if not (math.isfinite(delay_s) and delay_s >= 0):
            raise ValueError(f"an observed queue delay must be finite and >= 0 seconds (got {delay_s!r})")
        self._value_s += self.EMA_WEIGHT * (delay_s - self._value_s)
        self.observations += 1
        return self._value_s

    def apply(self, c: Coefficients) -> Coefficients:
        """The coefficients with t_queue replaced by the current estimate."""
        return dataclasses.replace(c, t_queue_s=self._value_s)


class AcceptLengthEstimator:
    """The accept length of Eq. 3 with a draft: tokens committed per verify, an exponential moving average
    over the windows between readings (a window's mean weighs EMA_WEIGHT), so one lucky or unlucky stretch
    does not swing the offload price; 1.0 until the first verify.

    It reads SGLang's running totals (tokens accepted, verifies). They grow, except that SGLang's
    POST /flush_cache zeroes them (scheduler.py:5528, metrics_reporter.py:708-715 reset_metrics): totals
    below the last reading restart the window from the new totals, keeping the estimate. A flush whose new
    totals outgrew the old ones before the next reading shows as a window of more tokens per verify than a
    verify can commit (its largest draft width, `most_per_verify`): it restarts the window too."""

    EMA_WEIGHT = 0.2  # the calibrator's smoothing

    def __init__(self) -> None:
        self.value: float = 1.0
        self.windows = 0  # windows folded in so far
        self._seen = (0, 0)

    def observe(self, accepted_tokens: int, verifies: int, most_per_verify: int | None = None) -> float:
        """Fold in the window since the last reading (totals so far); returns the new estimate."""
        tokens, steps = accepted_tokens - self._seen[0], verifies - self._seen[1]
        crossed_reset = tokens < 0 or steps < 0 or (most_per_verify is not None and tokens > most_per_verify * steps)
        if crossed_reset:  # SGLang reset its totals: the next window starts here
            self._seen = (accepted_tokens, verifies)
        elif steps:
            window = max(tokens / steps, 1.0)  # a verify commits at least its bonus token
            self.value = window if not self.windows else self.value + self.EMA_WEIGHT * (window - self.value)
            self.windows += 1
            self._seen = (accepted_tokens, verifies)
        return self.value
