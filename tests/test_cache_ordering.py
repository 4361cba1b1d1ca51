"""The eviction order (paper Eq. 1's p_eff) and the per-node cost C_c (Eq. 2), by hand.

Paper section V coefficients: alpha = 0.5, tau = 2,000 steps, t_prefill = 15 us, and t_overhead =
t_sched = 500 us (our reading, see policy/costs.py); r_hit = (hits + rate) / (hits + 1), where
rate is the node's prior (its writer class's observed reuse share: tests/test_reuse_share.py).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vamp_sglang.cache import CostOrder, NodeStats
from vamp_sglang.cache.ordering import EXPECTED, EXPECTED_MIN_REUSE, NOT_EXPECTED, reuse_interval_steps
from vamp_sglang.config import VampConfig
from vamp_sglang.policy.costs import Coefficients

ORDER = CostOrder(Coefficients.from_config(VampConfig()))


def stats(hits: int, last_step: int, created_step: int = 0, prior: float | None = None) -> NodeStats:
    return NodeStats(step=last_step, hits=hits, created_step=created_step, prior=prior)


def test_cost_and_priority_match_hand_computation():
    # r_hit = 3.5 / 4 = 0.875; p_eff = 0.5 * 0.875 / (1 + 2000 / 2000) = 0.21875
    # C_c = 0.21875 * (100 * 15 us + 500 us) = 437.5 us
    # reuse interval G = (1000 - 0) / 3 steps: expected back until 1000 + 1.5 * G = 1500, so at 3000 it is not
    node = stats(hits=3, last_step=1000)
    assert ORDER.cost_s(100, node, now_step=3000, prior=0.5) == pytest.approx(437.5e-6)
    group, p_eff, newest, last_step = ORDER.priority(node, now_step=3000, prior=0.5)
    assert group == NOT_EXPECTED and p_eff == pytest.approx(0.21875)
    assert (newest, last_step) == (0, 1000)


def test_a_node_is_expected_back_for_one_and_a_half_reuse_intervals():
    node = stats(hits=4, last_step=800, created_step=0)  # used every 200 steps
    assert reuse_interval_steps(node, 0.9, None) == 200.0
    assert reuse_interval_steps(node, EXPECTED_MIN_REUSE / 2, None) is None  # rarely reused: never expected back
    assert ORDER.priority(node, 1100, 0.5) == (EXPECTED, 1, -1000.0, 0)  # next use expected at step 1000
    assert ORDER.priority(node, 1101, 0.5)[0] == NOT_EXPECTED  # its use did not come: Eq. 1 prices it
    fresh = stats(hits=0, last_step=800, created_step=800)  # never hit: its writer class's interval
    assert ORDER.priority(fresh, 900, 0.5, class_gap_steps=150.0) == (EXPECTED, 0, -950.0, -800)
    assert ORDER.priority(fresh, 1026, 0.5, class_gap_steps=150.0)[0] == NOT_EXPECTED
    assert ORDER.priority(fresh, 800, 0.5)[0] == NOT_EXPECTED  # a class never seen reused: not expected back


def test_nodes_not_expected_back_go_first_then_the_farthest_next_use():
    overdue_hot = stats(hits=50, last_step=0, created_step=0)  # G = 1 step, long past
    soon = stats(hits=2, last_step=900, created_step=500)  # G = 200: expected at 1100
    later = stats(hits=1, last_step=950, created_step=350)  # G = 600: expected at 1550
    fresh = stats(hits=0, last_step=990, created_step=990)  # never hit, expected at 1090 (class interval 100)
    keys = [ORDER.priority(n, 1000, 0.5, class_gap_steps=100.0) for n in (overdue_hot, fresh, soon, later)]
    assert keys[0] < keys[1] < keys[3] < keys[2]


def test_the_prior_prices_a_never_hit_node():
    # never hit, its class's prior 0.9: r_hit = 0.9, p_eff = 0.45, C_c = 0.45 * 800 us = 360 us
    continuation = stats(hits=0, last_step=0, prior=0.9)
    assert ORDER.cost_s(20, continuation, 0, prior=0.9) == pytest.approx(360e-6)
    assert ORDER.priority(continuation, 3001, prior=0.9, class_gap_steps=2000.0)[1] == pytest.approx(0.45 / 2.5005)
    one_shot = stats(hits=0, last_step=5, prior=0.0)
    assert ORDER.priority(one_shot, 5, 0.0) == (NOT_EXPECTED, 0.0, 0, 5)  # r_hit = 0: never expected back
    assert ORDER.priority(one_shot, 5, 0.0) < ORDER.priority(continuation, 5, 0.9)


def test_order_ignores_node_size_where_whole_node_cost_would_not():
    # session turn: 30 tokens, 3 hits -> p = 0.5 * 3.3 / 4 = 0.4125, C_c = 0.4125 * 950 us = 391.875 us
    # one-shot prompt: 300 tokens, 0 hits -> p = 0.15, C_c = 0.15 * 5000 us = 750 us
    session, one_shot = stats(hits=3, last_step=0), stats(hits=0, last_step=0)
    assert ORDER.cost_s(30, session, 0, 0.3) == pytest.approx(391.875e-6)
    assert ORDER.cost_s(300, one_shot, 0, 0.3) == pytest.approx(750e-6)
    assert ORDER.priority(one_shot, 5000, 0.3) < ORDER.priority(session, 5000, 0.3)


def test_without_observed_reuse_the_newest_goes_first():
    """Every r_hit = 0 (nothing hit yet, as at start-up): the oldest KV stays, so sessions that take turns in a
    pool too small for all keep a stable subset, where LRU would evict each one just before its next turn."""
    old, new = stats(hits=0, last_step=9, created_step=1), stats(hits=0, last_step=5, created_step=5)
    assert ORDER.priority(old, 20, 0.0)[:2] == (NOT_EXPECTED, 0.0)
    assert ORDER.priority(new, 20, 0.0) < ORDER.priority(old, 20, 0.0)


@given(hits=st.integers(0, 1000), age=st.integers(0, 10**6), rate=st.floats(0.0, 0.99),
       tokens=st.integers(0, 10_000))
def test_value_rises_with_hits(hits, age, rate, tokens):
    now = 10**6
    low, high = stats(hits, now - age), stats(hits + 1, now - age)
    assert ORDER.cost_s(tokens, high, now, rate) >= ORDER.cost_s(tokens, low, now, rate)
    low_key, high_key = ORDER.priority(low, now, rate), ORDER.priority(high, now, rate)
    if low_key[0] == high_key[0] == NOT_EXPECTED:
        assert high_key > low_key


@given(hits=st.integers(0, 1000), age=st.integers(0, 10**6), rate=st.floats(0.01, 1.0))
def test_value_falls_with_age_once_not_expected_back(hits, age, rate):
    now = 2 * 10**6
    fresh, older = stats(hits, now - age), stats(hits, now - age - 1)
    fresh_key, older_key = ORDER.priority(fresh, now, rate), ORDER.priority(older, now, rate)
    if fresh_key[0] == NOT_EXPECTED:  # then so is the older one (expected until a later step for the fresh)
        assert older_key < fresh_key
    else:  # expected back: the one idle longer is nearer its next use, and stays
        assert older_key[0] == NOT_EXPECTED or older_key > fresh_key


def test_priority_prices_with_eq1s_own_floats():
    """CostOrder.priority inlines reuse_probability (it runs per leaf priced): the same floats, exactly."""
    import random

    from vamp_sglang.policy.costs import reuse_probability

    order, rng = CostOrder(Coefficients()), random.Random(0)
    checked = 0
    for _ in range(2000):
        stats = NodeStats(rng.randint(0, 5000), rng.randint(0, 50), 0, rng.choice([None, rng.random(), 0.0, 1.0]))
        now, rate = rng.randint(0, 9000), rng.random()
        key = order.priority(stats, now, rate, class_gap_steps=rng.choice([None, 1.0, 100.0]))
        if key[0] == NOT_EXPECTED:
            checked += 1
            assert key[1] == reuse_probability(stats.hits, stats.age_steps(now), rate, order.coefficients)
    assert checked > 500


def test_kv_rarely_reused_is_not_held_as_expected_back():
    """One-shot prompts behind a writer class that also writes some reused first turns get a small positive
    prior. Held as expected back for 1.5 intervals, they went after every session node whose next turn came
    later than usual (overdue, so first to go): with sessions arriving at random, those are the KV needed next.
    Below EXPECTED_MIN_REUSE a node goes by p_eff, where its small r_hit puts it before the overdue session."""
    order = CostOrder(Coefficients())
    one_shot = NodeStats(1000, 0, 1000, 0.0)  # never hit: r_hit is its class's prior, 0.02; class interval 100
    overdue_session = NodeStats(800, 3, 200, 0.9)  # hit 3 times, mean gap 200 steps: expected back until 1100
    now = 1150
    assert order.priority(one_shot, now, 0.02, 100.0)[0] == NOT_EXPECTED
    assert order.priority(overdue_session, now, 0.9, 100.0)[0] == NOT_EXPECTED
    assert order.priority(one_shot, now, 0.02, 100.0) < order.priority(overdue_session, now, 0.9, 100.0)
    # at the floor and above, a never-hit node is still expected back for its class's interval
    assert order.priority(one_shot, now, EXPECTED_MIN_REUSE, 100.0)[0] == EXPECTED
