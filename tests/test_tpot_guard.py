"""The TPOT guard's logic: smoothed step time, projected TPOT, the offload veto and the restore request."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vamp_sglang.policy.tpot_guard import TpotGuard, TpotGuardError


def test_nothing_measured_allows_offload_and_projects_nothing():
    guard = TpotGuard(slo_ms=100)
    assert guard.step_ms is None and guard.projected_tpot_ms(4) is None
    assert guard.allows_offload(4) and not guard.wants_restore()


def test_step_time_is_an_exponential_moving_mean():
    guard = TpotGuard(slo_ms=100, smoothing=0.5)
    for step_ms, want in ((40, 40), (80, 60), (80, 70), (20, 45)):
        guard.observe_decode_step(step_ms, 0)
        assert guard.step_ms == pytest.approx(want)


def test_projection_adds_the_measured_staging_cost_per_group():
    guard = TpotGuard(slo_ms=100, smoothing=1.0)
    guard.observe_decode_step(60, 4)
    guard.observe_staging(staged_groups=4, staging_ms=20)  # 5 ms a group
    assert guard.ms_per_group == 5
    assert guard.projected_tpot_ms(0) == 60 and guard.projected_tpot_ms(8) == 100
    assert guard.allows_offload(6) and not guard.allows_offload(7)  # 90 ms is the offload margin's edge


def test_prior_cost_until_a_measurement_replaces_it():
    guard = TpotGuard(slo_ms=100, smoothing=1.0, prior_ms_per_group=10)
    guard.observe_decode_step(70, 0)
    assert guard.allows_offload(2) and not guard.allows_offload(3)
    guard.observe_staging(3, 6)  # measured: 2 ms a group
    assert guard.ms_per_group == 2 and guard.allows_offload(10) and not guard.allows_offload(11)


def test_already_over_the_slo_rules_out_any_offload():
    guard = TpotGuard(slo_ms=50, smoothing=1.0)
    guard.observe_decode_step(55, 0)
    assert not guard.allows_offload(0) and not guard.allows_offload(1)
    assert not guard.wants_restore(), "nothing offloaded: nothing to restore"


def test_restore_wanted_only_after_patience_steps_over_the_slo_while_offloaded():
    guard = TpotGuard(slo_ms=50, smoothing=1.0, patience_steps=3)
    guard.observe_staging(4, 40)  # 10 ms a group: 80 ms steps are 40 ms without staging
    for _ in range(2):
        guard.observe_decode_step(80, 4)
    assert not guard.wants_restore()
    guard.observe_decode_step(40, 4)  # one step back inside the SLO resets the count
    for _ in range(2):
        guard.observe_decode_step(80, 4)
    assert not guard.wants_restore()
    guard.observe_decode_step(80, 4)
    assert guard.wants_restore()
    guard.restored()
    assert not guard.wants_restore()


def test_a_boundary_change_restarts_the_patience_count():
    guard = TpotGuard(slo_ms=50, smoothing=1.0, patience_steps=2)
    guard.observe_staging(4, 40)
    guard.observe_decode_step(80, 8)
    guard.observe_decode_step(80, 4)  # the caller restored 4 groups
    assert not guard.wants_restore()
    guard.observe_decode_step(80, 4)
    assert guard.wants_restore()


def test_a_step_slow_for_another_reason_never_asks_for_a_restore():
    """Issue 19.11: a prefill chunk between decode steps, or a bigger batch, made every step count as
    over the SLO while anything was offloaded, and the restore it asked for evicts: more prefill."""
    guard = TpotGuard(slo_ms=50, smoothing=1.0, patience_steps=2)
    guard.observe_staging(4, 4)  # staging costs 1 ms a group: 4 ms of an 80 ms step
    for _ in range(10):
        guard.observe_decode_step(80, 4)
    assert not guard.wants_restore()
    guard.observe_staging(4, 120)  # now the copies are what the step waits on (smoothing 1: 30 ms a group)
    for _ in range(2):
        guard.observe_decode_step(80, 4)
    assert guard.wants_restore()


def test_between_the_offload_margin_and_the_slo_neither_offload_nor_restore_happens():
    """Issue 19.11: the hysteresis band. An offload stops short of the SLO and a restore starts above
    it, so the step time one of them leads to does not at once call for the other."""
    guard = TpotGuard(slo_ms=100, smoothing=1.0, patience_steps=1)
    guard.observe_staging(2, 10)  # 5 ms a group
    guard.observe_decode_step(95, 2)
    assert not guard.allows_offload(0) and not guard.wants_restore()
    guard.observe_decode_step(101, 2)
    assert guard.wants_restore()


def test_smoothing_rides_out_a_single_slow_step():
    guard = TpotGuard(slo_ms=50, smoothing=0.2, patience_steps=1)
    for _ in range(20):
        guard.observe_decode_step(40, 4)
    guard.observe_decode_step(80, 4)  # 40 + 0.2 * 40 = 48: still inside
    assert guard.step_ms == pytest.approx(48, rel=1e-3) and not guard.wants_restore()


def test_stats_carry_what_the_decision_log_needs():
    guard = TpotGuard(slo_ms=75, smoothing=1.0)
    guard.observe_decode_step(30, 2)
    guard.observe_staging(2, 5)
    assert guard.stats() == {"slo_ms": 75, "step_ms": 30, "ms_per_group": 2.5, "over_slo_steps": 0}


@pytest.mark.parametrize("kwargs", [{"slo_ms": 0}, {"slo_ms": -1}, {"slo_ms": math.inf}, {"slo_ms": math.nan},
                                    {"slo_ms": 10, "smoothing": 0}, {"slo_ms": 10, "smoothing": 1.5},
                                    {"slo_ms": 10, "patience_steps": 0}, {"slo_ms": 10, "offload_below": 0},
                                    {"slo_ms": 10, "offload_below": 1.2},
                                    {"slo_ms": 10, "prior_ms_per_group": -1}])
def test_bad_settings_are_refused_naming_them(kwargs):
    bad = [k for k in kwargs if k != "slo_ms"] or ["slo_ms"]
    with pytest.raises(TpotGuardError, match=bad[-1]):
        TpotGuard(**kwargs)


def test_bad_measurements_are_refused():
    guard = TpotGuard(slo_ms=10)
    with pytest.raises(TpotGuardError, match="step_ms"):
        guard.observe_decode_step(-1, 0)
    with pytest.raises(TpotGuardError, match="offloaded_groups"):
        guard.observe_decode_step(1, -2)
    with pytest.raises(TpotGuardError, match="staged_groups"):
        guard.observe_staging(0, 1.0)
    with pytest.raises(TpotGuardError, match="n_groups"):
        guard.projected_tpot_ms(-1)


@given(st.lists(st.floats(0, 1000), min_size=1, max_size=50), st.floats(0.01, 1.0),
       st.integers(0, 64), st.floats(1, 500))
def test_allows_offload_is_exactly_the_projection_inside_the_slo(steps, smoothing, n, slo):
    guard = TpotGuard(slo_ms=slo, smoothing=smoothing, prior_ms_per_group=1.5)
    for step in steps:
        guard.observe_decode_step(step, 0)
    assert min(steps) - 1e-6 <= guard.step_ms <= max(steps) + 1e-6
    assert guard.allows_offload(n) == (guard.step_ms + 1.5 * n <= 0.9 * slo)
    assert all(guard.allows_offload(m) for m in range(n)) or not guard.allows_offload(n)
