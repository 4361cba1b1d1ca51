"""The eviction order (paper Eq. 1's p_eff) and the per-node cost C_c (Eq. 2), by hand.

Paper section V coefficients: alpha = 0.5, tau = 2,000 steps, t_prefill = 15 us, and t_overhead =
t_sched = 500 us (our reading, see policy/costs.py); r_hit = (hits + rate) / (hits + 1), where
rate is the node's prior (its writer class's observed reuse share: tests/test_reuse_share.py).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vamp_sglang.cache import CostOrder, NodeStats
from vamp_sglang.config import VampConfig
from vamp_sglang.policy.costs import Coefficients

ORDER = CostOrder(Coefficients.from_config(VampConfig()))


def stats(hits: int, last_step: int, created_step: int = 0, prior: float | None = None) -> NodeStats:
    return NodeStats(step=last_step, hits=hits, created_step=created_step, prior=prior)


def test_cost_and_priority_match_hand_computation():
    # r_hit = 3.5 / 4 = 0.875; p_eff = 0.5 * 0.875 / (1 + 2000 / 2000) = 0.21875
    # C_c = 0.21875 * (100 * 15 us + 500 us) = 437.5 us
    node = stats(hits=3, last_step=1000)
    assert ORDER.cost_s(100, node, now_step=3000, prior=0.5) == pytest.approx(437.5e-6)
    p_eff, last_step, created_step = ORDER.priority(node, now_step=3000, prior=0.5)
    assert p_eff == pytest.approx(0.21875)
    assert (last_step, created_step) == (1000, 0)


def test_the_prior_prices_a_never_hit_node():
    # never hit, its class's prior 0.9: r_hit = 0.9, p_eff = 0.45, C_c = 0.45 * 800 us = 360 us
    continuation = stats(hits=0, last_step=0, prior=0.9)
    assert ORDER.priority(continuation, 0, prior=0.9)[0] == pytest.approx(0.45)
    assert ORDER.cost_s(20, continuation, 0, prior=0.9) == pytest.approx(360e-6)
    one_shot = stats(hits=0, last_step=5, prior=0.0)
    assert ORDER.priority(one_shot, 5, 0.0)[0] == 0.0
    assert ORDER.priority(one_shot, 5, 0.0) < ORDER.priority(continuation, 5, 0.9)


def test_order_ignores_node_size_where_whole_node_cost_would_not():
    # session turn: 30 tokens, 3 hits -> p = 0.5 * 3.3 / 4 = 0.4125, C_c = 0.4125 * 950 us = 391.875 us
    # one-shot prompt: 300 tokens, 0 hits -> p = 0.15, C_c = 0.15 * 5000 us = 750 us
    session, one_shot = stats(hits=3, last_step=0), stats(hits=0, last_step=0)
    assert ORDER.cost_s(30, session, 0, 0.3) == pytest.approx(391.875e-6)
    assert ORDER.cost_s(300, one_shot, 0, 0.3) == pytest.approx(750e-6)
    assert ORDER.priority(one_shot, 0, 0.3) < ORDER.priority(session, 0, 0.3)


def test_without_observed_reuse_the_order_is_lru():
    old, new = stats(hits=0, last_step=5, created_step=5), stats(hits=0, last_step=9, created_step=1)
    assert ORDER.priority(old, 20, 0.0)[0] == 0.0
    assert ORDER.priority(old, 20, 0.0) < ORDER.priority(new, 20, 0.0)


@given(hits=st.integers(0, 1000), age=st.integers(0, 10**6), rate=st.floats(0.0, 0.99),
       tokens=st.integers(0, 10_000))
def test_value_rises_with_hits(hits, age, rate, tokens):
    now = 10**6
    low, high = stats(hits, now - age), stats(hits + 1, now - age)
    assert ORDER.priority(high, now, rate)[0] > ORDER.priority(low, now, rate)[0]
    assert ORDER.cost_s(tokens, high, now, rate) >= ORDER.cost_s(tokens, low, now, rate)


@given(hits=st.integers(0, 1000), age=st.integers(0, 10**6), rate=st.floats(0.01, 1.0))
def test_value_falls_with_age(hits, age, rate):
    now = 2 * 10**6
    fresh, older = stats(hits, now - age), stats(hits, now - age - 1)
    assert ORDER.priority(older, now, rate) < ORDER.priority(fresh, now, rate)


def test_priority_prices_with_eq1s_own_floats():
    """CostOrder.priority inlines reuse_probability (it runs per leaf priced): the same floats, exactly."""
    import random

    from vamp_sglang.policy.costs import reuse_probability

    order, rng = CostOrder(Coefficients()), random.Random(0)
    for _ in range(2000):
        stats = NodeStats(rng.randint(0, 5000), rng.randint(0, 50), 0, rng.choice([None, rng.random(), 0.0, 1.0]))
        now, rate = rng.randint(0, 9000), rng.random()
        expected = reuse_probability(stats.hits, stats.age_steps(now), rate, order.coefficients)
        assert order.priority(stats, now, rate)[0] == expected
