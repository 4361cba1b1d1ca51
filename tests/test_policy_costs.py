"""Each cost equation of paper section IV-B against numbers worked out by hand from section V's
coefficients: alpha 0.5, tau 2000 steps, t_prefill 15 us, t_sched 500 us, t_queue 1000 us,
c_reload 0.63 ms; with k = 10 and E = 512, c_eff = 0.63 ms * 10 / 512 = 12.3046875 us (the paper's 12.3 us)."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vamp_sglang.config import VampConfig
from vamp_sglang.policy import (
    Coefficients,
    QueueDelayEstimator,
    cached_block_cost_s,
    combined_cost_s,
    offload_cost_s,
    preempt_cost_s,
    reuse_probability,
)

C = Coefficients()
US = 1e-6


def test_defaults_are_the_papers_section_v_values_in_seconds():
    assert C == Coefficients.from_config(VampConfig())
    assert (C.alpha, C.tau_steps, C.expand_groups) == (0.5, 2000, 4)
    assert C.t_prefill_s == pytest.approx(15 * US)
    assert C.t_sched_s == pytest.approx(500 * US)
    assert C.t_queue_s == pytest.approx(1000 * US)
    assert C.c_reload_s == pytest.approx(0.63e-3)
    # The paper's c_eff: 0.63 ms * 10 / 512 = 12.3046875 us.
    assert C.c_reload_s * 10 / 512 == pytest.approx(12.3046875 * US)


def test_eq1_reuse_probability():
    # Never hit, fresh: r_hit is the observed rate 0.3 -> p = 0.5 * 0.3 / (1 + 0) = 0.15.
    assert reuse_probability(0, 0, 0.3, C) == pytest.approx(0.15)
    # 3 hits, prior 0.2: r_hit = (3 + 0.2) / 4 = 0.8; age 2000 = tau -> p = 0.5 * 0.8 / 2 = 0.2.
    assert reuse_probability(3, 2000, 0.2, C) == pytest.approx(0.2)
    # Age 6000 = 3 tau halves it twice over: 0.5 * 0.8 / 4 = 0.1.
    assert reuse_probability(3, 6000, 0.2, C) == pytest.approx(0.1)


def test_eq2_cached_block_cost():
    # p = 0.2 (above); 1000 tokens * 15 us + t_overhead (= t_sched) 500 us = 15,500 us -> 3,100 us.
    assert cached_block_cost_s(1000, 3, 2000, 0.2, C) == pytest.approx(3100 * US)
    # Never hit under a workload with no reuse at all: free to evict.
    assert cached_block_cost_s(1000, 0, 0, 0.0, C) == 0.0


def test_eq3_offload_cost():
    # 4 groups * 3 shards = 12 shards; w = min(100, 64) = 64 -> 12 * 12.3046875 us * 64 = 9,450 us.
    assert offload_cost_s(4, 3, 512, 10, 100, C) == pytest.approx(9450 * US)
    # 200 groups * 3 = 600 shards, capped at E = 512; w = max(0, 1) = 1 -> 512 * 12.3046875 us = 6,300 us.
    assert offload_cost_s(200, 3, 512, 10, 0, C) == pytest.approx(6300 * US)
    # w = 7 inside the clamp: 12 * 12.3046875 * 7 = 1,033.59375 us.
    assert offload_cost_s(4, 3, 512, 10, 7, C) == pytest.approx(1033.59375 * US)
    assert offload_cost_s(0, 3, 512, 10, 64, C) == 0.0


def test_eq4_eq5_preempt_cost():
    # Victim 1: 500 + 1000 + 100 * 15 = 3,000 us; victim 2: 500 + 1000 + 40 * 15 = 2,100 us.
    assert preempt_cost_s([100, 40], C) == pytest.approx(5100 * US)
    # Equal victims: C_p = C_p^(1) * G = 3,000 us * 3.
    assert preempt_cost_s([100, 100, 100], C) == pytest.approx(9000 * US)
    assert preempt_cost_s([], C) == 0.0


def test_eq6_combined_cost_is_floor_offload_plus_remainder_eviction():
    # C_e(4 groups) = 9,450 us (Eq. 3 above) + C_c = 3,100 us (Eq. 2 above) = 12,550 us.
    c_e = offload_cost_s(4, 3, 512, 10, 100, C)
    c_c = cached_block_cost_s(1000, 3, 2000, 0.2, C)
    assert combined_cost_s(c_e, c_c) == pytest.approx(12550 * US)


def test_queue_delay_estimator_follows_observations():
    q = QueueDelayEstimator(C.t_queue_s)
    assert q.value_s == pytest.approx(1000 * US)
    # EMA weight 0.2: 1000 + 0.2 * (6000 - 1000) = 2,000 us.
    assert q.observe(6000 * US) == pytest.approx(2000 * US)
    # One victim with 100 partial tokens now costs 500 + 2000 + 1500 = 4,000 us.
    assert preempt_cost_s([100], q.apply(C)) == pytest.approx(4000 * US)
    with pytest.raises(ValueError, match="finite and >= 0"):
        q.observe(-1.0)


def test_overrides_by_config_field_name_convert_units_and_validate():
    c = C.with_overrides({"t_prefill_us": 30, "c_reload_ms": 1.26, "expand_groups": 2})
    assert c.t_prefill_s == pytest.approx(30 * US) and c.c_reload_s == pytest.approx(1.26e-3)
    assert c.expand_groups == 2 and c.alpha == C.alpha
    assert C.as_overrides() == {"alpha": 0.5, "tau_steps": 2000, "t_prefill_us": 15, "t_sched_us": 500,
                                "t_queue_us": 1000, "c_reload_ms": 0.63, "expand_groups": 4}
    with pytest.raises(ValueError, match="--vamp-alpha must be in"):
        C.with_overrides({"alpha": 2.0})
    with pytest.raises(ValueError, match="unknown coefficient 'beta'"):
        C.with_overrides({"beta": 1.0})
    with pytest.raises(ValueError, match="Coefficients.t_prefill_s"):
        dataclasses.replace(C, t_prefill_s=float("nan"))


hits = st.integers(0, 10_000)
ages = st.integers(0, 10**7)
rates = st.floats(0.0, 1.0)
tokens = st.integers(1, 10**6)


@given(tokens, hits, ages, rates)
def test_eviction_cost_rises_with_hits(n, h, age, rate):
    lower, higher = cached_block_cost_s(n, h, age, rate, C), cached_block_cost_s(n, h + 1, age, rate, C)
    assert higher >= lower
    if rate < 0.999:  # below a perfect prior every extra hit is real evidence of reuse
        assert higher > lower


@given(tokens, hits, ages, rates)
def test_eviction_cost_falls_with_age(n, h, age, rate):
    fresh, older = cached_block_cost_s(n, h, age, rate, C), cached_block_cost_s(n, h, age + 100, rate, C)
    assert older <= fresh
    if h > 0 or rate > 1e-6:  # (a rate near 0 underflows to a zero cost)
        assert older < fresh
