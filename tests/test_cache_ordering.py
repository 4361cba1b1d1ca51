"""The C_c eviction order (paper Eq. 2 per token), checked against hand-computed values.

Paper section V coefficients: alpha = 0.5, tau = 2,000 steps, t_prefill = 15 us, and t_overhead =
t_sched = 500 us (our reading, see policy/costs.py); r_hit = (hits + observed) / (hits + 1).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vamp_sglang.cache import CostOrder, NodeStats
from vamp_sglang.config import VampConfig
from vamp_sglang.policy.costs import Coefficients

ORDER = CostOrder(Coefficients.from_config(VampConfig()))


def stats(hits: int, last_step: int, created_step: int = 0) -> NodeStats:
    return NodeStats(step=last_step, hits=hits, created_step=created_step)


def test_cost_matches_hand_computation():
    # r_hit = 3.5 / 4 = 0.875; p_eff = 0.5 * 0.875 / (1 + 2000 / 2000) = 0.21875
    # C_c = 0.21875 * (100 * 15 us + 500 us) = 437.5 us
    node = stats(hits=3, last_step=1000)
    assert ORDER.cost_s(100, node, now_step=3000, observed_hit_rate=0.5) == pytest.approx(437.5e-6)
    per_token_s, last_step, created_step = ORDER.priority(100, node, now_step=3000, observed_hit_rate=0.5)
    assert per_token_s == pytest.approx(4.375e-6)
    assert (last_step, created_step) == (1000, 0)


def test_large_cold_prompt_goes_before_small_warm_session_turn():
    # session turn: 30 tokens, 3 hits -> r = 3.3 / 4, p = 0.4125, C_c = 0.4125 * 950 us = 391.875 us
    # one-shot prompt: 300 tokens, 0 hits -> r = 0.3, p = 0.15, C_c = 0.15 * 5000 us = 750 us
    session, one_shot = stats(hits=3, last_step=0), stats(hits=0, last_step=0)
    assert ORDER.cost_s(30, session, 0, 0.3) == pytest.approx(391.875e-6)
    assert ORDER.cost_s(300, one_shot, 0, 0.3) == pytest.approx(750e-6)
    # whole-node C_c would evict the session turn first; per token (13.06 us vs 2.5 us) it stays
    assert ORDER.priority(300, one_shot, 0, 0.3) < ORDER.priority(30, session, 0, 0.3)


def test_without_observed_reuse_the_order_is_lru():
    old, new = stats(hits=0, last_step=5, created_step=5), stats(hits=0, last_step=9, created_step=1)
    assert ORDER.priority(10, old, 20, 0.0)[0] == 0.0
    assert ORDER.priority(500, old, 20, 0.0) < ORDER.priority(10, new, 20, 0.0)


@given(tokens=st.integers(1, 10_000), hits=st.integers(0, 1000), age=st.integers(0, 10**6),
       rate=st.floats(0.0, 0.99))
def test_priority_rises_with_hits(tokens, hits, age, rate):
    now = 10**6
    low = ORDER.priority(tokens, stats(hits, now - age), now, rate)
    high = ORDER.priority(tokens, stats(hits + 1, now - age), now, rate)
    assert high[0] > low[0]


@given(tokens=st.integers(1, 10_000), hits=st.integers(0, 1000), age=st.integers(0, 10**6),
       rate=st.floats(0.01, 1.0))
def test_priority_falls_with_age(tokens, hits, age, rate):
    now = 2 * 10**6
    fresh = ORDER.priority(tokens, stats(hits, now - age), now, rate)
    older = ORDER.priority(tokens, stats(hits, now - age - 1), now, rate)
    assert older < fresh
