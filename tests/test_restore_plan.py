"""When experts come back (policy/restore.py): pure cases, each a reason a serving engineer can read."""

import dataclasses

from vamp_sglang.policy.restore import IDLE_RESTORE_S, RestoreState, plan_restore

BUSY = RestoreState(idle=False, idle_s=0.0, calm_steps=0, tpot_over_slo=False, restore_after_steps=100,
                    offloaded_groups=6, expand_groups=4, pool_tokens=10000, keep_tokens=6000, used_tokens=3000,
                    evictable_tokens=2500, baseline_tokens=2000, tail_free=False, can_compact=True)


def plan(**changes):
    return plan_restore(dataclasses.replace(BUSY, **changes))


def test_busy_restores_only_once_calm_and_then_moves_rows_without_evicting():
    assert plan(calm_steps=99).groups == 0
    p = plan(calm_steps=100)
    assert (p.groups, p.evict_tokens, p.compact) == (4, 0, True)
    assert plan(calm_steps=100, tail_free=True).compact is False
    # calm can still need eviction if the pool filled meanwhile: a calm restore never evicts
    assert plan(calm_steps=100, used_tokens=7000).groups == 0


def test_over_the_tpot_slo_a_step_comes_back_evicting_only_as_far_as_needed():
    p = plan(tpot_over_slo=True, used_tokens=7000)
    assert (p.groups, p.evict_tokens, p.compact) == (4, 1000, True) and "TPOT" in p.reason


def test_nothing_is_evicted_when_the_restore_cannot_happen():
    for blocked in ({"can_compact": False}, {"used_tokens": 9000}):  # a request holds the tail / too full
        p = plan(tpot_over_slo=True, **blocked)
        assert (p.groups, p.evict_tokens) == (0, 0), p


def test_idle_waits_for_wall_clock_seconds_and_the_last_step_takes_what_is_left():
    assert plan(idle=True, idle_s=IDLE_RESTORE_S - 0.1).groups == 0
    assert plan(idle=True, idle_s=IDLE_RESTORE_S, offloaded_groups=3, tail_free=True).groups == 3
    assert plan(idle=True, idle_s=60.0, restore_after_steps=0).groups == 0  # restoring disabled


def test_a_state_pool_restore_evicts_the_states_the_smaller_pool_cannot_hold_only_when_idle():
    """Hybrid models: 300 slots in use (cached states), the state pool shrinking to 6 slots."""
    hybrid = {"keep_tokens": BUSY.pool_tokens, "used_state_slots": 300, "keep_state_slots": 6,
              "evictable_states": 300}
    p = plan(idle=True, idle_s=IDLE_RESTORE_S, **hybrid)
    assert (p.groups, p.evict_tokens, p.evict_states, p.compact) == (4, 0, 294, True) and "294 states" in p.reason
    assert plan(calm_steps=100, **hybrid).groups == 0  # a calm restore never evicts
    blocked = plan(idle=True, idle_s=IDLE_RESTORE_S, **{**hybrid, "evictable_states": 290})  # requests hold 10
    assert (blocked.groups, blocked.evict_states) == (0, 0)
    assert plan(idle=True, idle_s=IDLE_RESTORE_S, **{**hybrid, "used_state_slots": 5}).evict_states == 0


def test_a_busy_restore_leaves_the_running_batchs_reservations_free():
    """Issue 19.11: over the SLO a restore evicted down to exactly the smaller pool, so the running
    requests' next decode tokens and a chunked prefill's next chunk met a full pool: a shortfall at
    once, which offloaded the experts again."""
    p = plan(tpot_over_slo=True, used_tokens=5900, reserve_tokens=600)
    assert (p.groups, p.evict_tokens, p.compact) == (4, 500, True)
    tail = plan(tpot_over_slo=True, used_tokens=5900, reserve_tokens=600, tail_free=True)
    assert (tail.groups, tail.evict_tokens, tail.compact) == (4, 500, False) and "compact" not in tail.reason
    assert plan(calm_steps=100, used_tokens=5900, reserve_tokens=600).groups == 0  # a calm restore never evicts
    assert plan(tpot_over_slo=True, used_tokens=5900, reserve_tokens=3000).groups == 0  # 2900 > 2500 evictable
    assert plan(tpot_over_slo=True, used_tokens=5000, reserve_tokens=600).evict_tokens == 0
