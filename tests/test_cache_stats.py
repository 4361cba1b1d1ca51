"""Per-node statistics, the admission ledger and the stats histograms (pure Python)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vamp_sglang.cache import AdmissionLedger, NodeStats, pow2_histogram


def test_admission_counts_a_hit_only_for_first_admissions():
    stats = NodeStats(step=3)
    stats.admit(step=10, count_hit=True)
    stats.admit(step=12, count_hit=False)  # a retracted request coming back
    assert (stats.hits, stats.last_step, stats.created_step) == (1, 12, 3)


def test_touch_never_moves_recency_backwards_and_age_is_never_negative():
    stats = NodeStats(step=50)
    stats.touch(20)
    assert stats.last_step == 50
    assert stats.age_steps(80) == 30
    assert stats.age_steps(10) == 0


def test_copy_is_independent():
    stats = NodeStats(step=4, hits=2, created_step=1, prior=0.75)
    twin = stats.copy()
    twin.admit(9, count_hit=True)
    assert (stats.hits, stats.last_step, stats.created_step, stats.prior) == (2, 4, 1, 0.75)
    assert (twin.hits, twin.last_step, twin.created_step, twin.prior) == (3, 9, 1, 0.75)


def test_bad_stats_are_refused():
    with pytest.raises(ValueError, match="hits >= 0"):
        NodeStats(step=0, hits=-1)
    with pytest.raises(ValueError, match="prior must be a hit rate"):
        NodeStats(step=0, prior=1.5)


def test_ledger_hit_rate_is_hit_tokens_over_requested_tokens():
    ledger = AdmissionLedger()
    assert ledger.hit_rate == 0.0
    ledger.record(hit_tokens=30, requested_tokens=40)
    ledger.record(hit_tokens=0, requested_tokens=60)
    assert (ledger.admissions, ledger.hit_rate) == (2, 0.3)
    with pytest.raises(ValueError, match="hit_tokens <= requested_tokens"):
        ledger.record(hit_tokens=5, requested_tokens=4)


def test_histogram_buckets_double():
    hist = pow2_histogram([0, 0, 1, 2, 3, 4, 7, 8, 63, 64, 1000], top=64)
    assert hist == {"0": 2, "1": 1, "2-3": 2, "4-7": 2, "8-15": 1, "16-31": 0, "32-63": 1, ">=64": 2}


@given(st.lists(st.integers(min_value=0, max_value=10**6)), st.sampled_from([2, 8, 64, 65536]))
def test_histogram_counts_every_value_once(values, top):
    assert sum(pow2_histogram(values, top).values()) == len(values)


def test_histogram_refuses_bad_input():
    with pytest.raises(ValueError, match="power of two"):
        pow2_histogram([1], top=10)
    with pytest.raises(ValueError, match="values >= 0"):
        pow2_histogram([-1], top=8)
