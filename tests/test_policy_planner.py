"""The planner (paper section IV-B) and the snapshot format: worked cases and hypothesis properties.

Feasibility is checked here from the snapshot itself, not from the planner's cost table: a gap
can be covered iff offloading all headroom plus evicting everything evictable covers it, or (at
decode only) retracting every candidate does."""

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vamp_sglang.policy import (
    COST_KEYS,
    POLICIES,
    Coefficients,
    EvictableBlock,
    OffloadState,
    PreemptCandidate,
    Snapshot,
    SnapshotError,
    cached_block_cost_s,
    plan,
)

C = Coefficients()
US = 1e-6


def snap(gap, evictable=(), headroom=10, site="decode", preempt=(), hit_rate=0.3, budget=100, free=0,
         buffer=0, per_group=64, **extra):
    """Every node priced with the tree-wide rate as its prior; victims need one row each."""
    return Snapshot.from_json({
        "site": site, "gap_tokens": gap, "free_tokens": free, "observed_hit_rate": hit_rate,
        "evictable": [{"tokens": t, "hits": h, "age_steps": a, "prior_hit_rate": hit_rate}
                      for t, h, a in evictable],
        "offload": {"headroom_groups": headroom, "tokens_by_groups": [per_group * n for n in range(1, headroom + 1)],
                    "shards_per_group": 3, "local_experts": 512, "top_k": 10, "decode_budget_min": budget},
        "preempt": [{"partial_tokens": p, "tokens": t, "decode_tokens": 1} for p, t in preempt],
        "retract_buffer_tokens": buffer, **extra})


EVICTABLE = [(150, 0, 4000), (64, 1, 100), (200, 5, 10)]  # in the tree's eviction order
PREEMPT = [(100, 180), (40, 200)]


def test_worked_example_all_four_costs():
    p = plan(snap(300, EVICTABLE, preempt=PREEMPT), C)
    # offload: ceil(300/64) = 5 groups -> 8 (expand step 4) -> 24 shards * 12.3046875 us * 64 = 18,900 us.
    assert p.costs["offload"] == pytest.approx(18900 * US)
    # preempt as retract_decode runs it: the first victim frees 180 rows (C_p^(1) = 500 + 1000 +
    # 100 * 15 = 3,000 us), then the step's re-check evicts the 119 rows still short from the tree,
    # in its order: the first node (150 tokens, 137.5 us below). 3,137.5 us.
    assert p.costs["preempt"] == pytest.approx(3137.5 * US)
    # C_c per node: (150, 0, 4000): 0.5 * 0.3 / 3 * (2250 + 500) = 137.5 us;
    # (64, 1, 100): 0.5 * 0.65 / 1.05 * (960 + 500) = 451.905 us;
    # (200, 5, 10): 0.5 * (5.3 / 6) / 1.005 * (3000 + 500) = 1538.14 us.
    # combined: floor 4 groups (256 tokens) = 9,450 us + cheapest node for the 44 left = 9,587.5 us.
    assert p.costs["combined"] == pytest.approx(9587.5 * US)
    assert (p.action, p.groups, p.evict_tokens) == ("evict", 0, 300)
    assert p.costs["evict"] == pytest.approx((137.5 + 451.9048 + 1538.1427) * US, rel=1e-5)


def test_reuse_makes_offload_win_and_no_reuse_makes_eviction_win():
    # Session prefixes of 4,000 tokens reused every turn: evicting one costs about
    # 0.5 * (50.9 / 51) * (4000 * 15 + 500) us = 30.2 ms; offloading 4 groups costs 9.45 ms.
    hot = [(4000, 50, 0)] * 4
    p = plan(snap(256, hot, hit_rate=0.9), C)
    assert (p.action, p.groups) == ("offload", 4) and p.costs["offload"] < p.costs["evict"]
    cold = [(4000, 0, 5000)] * 4  # one-shot prompts, long unused, workload without reuse: C_c = 0
    assert plan(snap(256, cold, hit_rate=0.0), C).action == "evict"


def test_no_headroom_leaves_only_evict_and_preempt():
    p = plan(snap(100, [(50, 0, 0)], headroom=0, preempt=[(10, 200)]), C)
    assert p.costs["offload"] is None and p.costs["combined"] is None and p.costs["evict"] is None
    assert p.action == "preempt" and p.costs["preempt"] == pytest.approx(1650 * US)  # 500 + 1000 + 150


def test_no_preemption_at_prefill_and_partial_when_nothing_covers():
    p = plan(snap(1000, [(50, 0, 0)], headroom=2, site="prefill", preempt=[(10, 5000)]), C)
    assert p.action == "partial" and not p.feasible
    assert (p.groups, p.evict_tokens) == (2, 50) and all(v is None for v in p.costs.values())


def test_offload_is_capped_at_headroom_and_combined_may_use_all_headroom():
    # 5 groups needed, rounding to 8 would exceed headroom 6: offload the 6.
    assert plan(snap(300, headroom=6), C).groups == 6
    # ceil(250 / 64) = 4 groups needed, headroom 3 (below one expand step of 4): all 3 groups
    # plus eviction of 250 - 192 = 58 tokens, although neither alone covers the gap.
    p = plan(snap(250, [(200, 0, 0)], headroom=3, hit_rate=1.0), C)
    assert (p.action, p.groups, p.evict_tokens) == ("combined", 3, 58)


def test_ablation_policies_ignore_cost_order():
    s = snap(256, [(4000, 50, 0)] * 4, hit_rate=0.9)  # offload cheaper, eviction feasible
    assert plan(s, C, "cost").action == "offload"
    assert plan(s, C, "evict-first").action == "evict"
    s = snap(256, [(4000, 0, 5000)] * 4, hit_rate=0.0)  # eviction free, offload feasible
    assert plan(s, C, "offload-first").action == "offload"
    s = snap(300, [(100, 0, 0)], headroom=4)  # neither alone covers: combined
    assert plan(s, C, "offload-first").action == "combined" == plan(s, C, "evict-first").action


def test_no_gap_means_no_action_and_coefficient_overrides_apply():
    assert plan(snap(0), C).action == plan(snap(-5), C).action == "none"
    # t_prefill doubled: the single victim costs 500 + 1000 + 10 * 30 = 1,800 us.
    p = plan(snap(100, headroom=0, preempt=[(10, 200)], coefficients={"t_prefill_us": 30}), C)
    assert p.costs["preempt"] == pytest.approx(1800 * US)


def test_retraction_is_priced_with_the_eviction_sglang_runs_after_it():
    """Issue 9.3: after retracting a victim SGLang evicts until 20 rows per remaining request are
    free (release_req), then the step re-checks. Both evictions are part of C_p."""
    # 4 running (3 victims), 2 rows free, the step needs 4: gap 2. Victim 1 frees 3 rows at once,
    # but SGLang then wants 3 * 20 = 60 free: 55 more from the tree (the 150-token node, 137.5 us).
    p = plan(snap(2, EVICTABLE, headroom=0, preempt=[(10, 3), (10, 3), (10, 3)], free=2, buffer=20), C)
    assert p.costs["preempt"] == pytest.approx((1650 + 137.5) * US)
    # Without that buffer only the victim's own rows count and nothing is evicted.
    p = plan(snap(2, EVICTABLE, headroom=0, preempt=[(10, 3), (10, 3), (10, 3)], free=2, buffer=0), C)
    assert p.costs["preempt"] == pytest.approx(1650 * US)


def test_retraction_that_cannot_cover_even_with_the_tree_is_infeasible():
    # The one kept request's step still needs 500 rows: no victims and tree cover it.
    p = plan(snap(600, [(10, 0, 0)], headroom=0, preempt=[(0, 50)], free=0, buffer=20), C)
    assert p.costs["preempt"] is None and p.action == "partial"


def test_exact_group_gains_where_the_first_groups_add_nothing():
    """Issue 9.2: pages per buffer round down, so one group may add 0 tokens while headroom > 0.
    Such a snapshot is valid, and offload takes as many groups as really cover the gap."""
    s = Snapshot.from_json({**snap(100, headroom=8).to_json(),
                            "offload": {**snap(100, headroom=8).to_json()["offload"],
                                        "tokens_by_groups": [0, 0, 0, 0, 0, 0, 128, 128]}})
    p = plan(s, C)
    assert (p.action, p.groups) == ("offload", 8)  # 4 groups add nothing; the step of 8 adds 128
    assert p.costs["combined"] is None  # the floor below the gap (4 groups) adds nothing


def test_each_node_is_priced_with_its_own_prior():
    """Issue 9.6: the tree prices a never-hit node with its writer's hit rate, so must the planner."""
    base = snap(100, [(100, 0, 0)], headroom=0).to_json()
    costs = []
    for prior in (0.0, 0.9):
        base["evictable"][0]["prior_hit_rate"] = prior
        costs.append(plan(Snapshot.from_json(base), C).costs["evict"])
    assert costs[0] == 0.0 and costs[1] == pytest.approx(0.5 * 0.9 * (100 * 15 + 500) * US)


# --- properties ----------------------------------------------------------------------------------
blocks = st.lists(st.builds(EvictableBlock, st.integers(1, 5000), st.integers(0, 100), st.integers(0, 10**6),
                            st.floats(0.0, 1.0), reprefill_tokens=st.none(), host_copy=st.just(False)), max_size=12)
victims = st.lists(st.builds(PreemptCandidate, st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 16)),
                   max_size=6)


@st.composite
def gains(draw, headroom):
    """Exact tokens per number of groups: non-decreasing, the first groups may add nothing."""
    steps = draw(st.lists(st.integers(0, 512), min_size=headroom, max_size=headroom))
    return tuple(sum(steps[:n]) for n in range(1, headroom + 1))


@st.composite
def snapshots(draw):
    headroom = draw(st.integers(0, 40))
    offload = OffloadState(headroom, draw(gains(headroom)), draw(st.integers(1, 8)),
                           draw(st.integers(1, 512)), draw(st.integers(1, 16)), draw(st.integers(0, 500)))
    coefficients = draw(st.fixed_dictionaries({}, optional={"expand_groups": st.integers(1, 8),
                                                            "alpha": st.floats(0.01, 1.0)}))
    return Snapshot(draw(st.sampled_from(["prefill", "decode"])), draw(st.integers(-10, 20_000)),
                    draw(st.integers(0, 2000)), tuple(draw(blocks)), offload, tuple(draw(victims)),
                    draw(st.integers(0, 64)), draw(st.floats(0.0, 1.0)), coefficients)


def retraction_covers(s):
    """Whether retracting every candidate, with SGLang's evictions in between, frees the step's need."""
    need = s.gap_tokens + s.free_tokens - sum(v.decode_tokens for v in s.preempt)
    return s.site == "decode" and bool(s.preempt) and (
        s.free_tokens + sum(v.tokens for v in s.preempt) + sum(e.tokens for e in s.evictable) >= need)


def covers(s, p):
    """Whether `p` really covers the gap of `s`, judged from the snapshot alone."""
    o, evictable = s.offload, sum(e.tokens for e in s.evictable)
    if p.action == "none":
        return s.gap_tokens <= 0
    if p.action == "preempt":
        return retraction_covers(s)
    return (p.groups <= o.headroom_groups and p.evict_tokens <= evictable
            and s.offload_tokens(p.groups) + p.evict_tokens >= s.gap_tokens)


def coverable(s):
    return (s.gap_tokens <= s.offload_tokens(s.offload.headroom_groups) + sum(e.tokens for e in s.evictable)
            or retraction_covers(s))


@settings(max_examples=300)
@given(snapshots(), st.sampled_from(POLICIES))
def test_plan_covers_the_gap_whenever_the_gap_can_be_covered(s, policy):
    p = plan(s, C, policy)
    assert set(p.costs) == set(COST_KEYS)
    if coverable(s):
        assert p.feasible and covers(s, p), p
        assert p.action == "none" or p.costs[p.action] is not None
    else:
        assert p.action == "partial" and all(v is None for v in p.costs.values())


@settings(max_examples=300)
@given(snapshots())
def test_cost_policy_picks_the_cheapest_feasible_plan(s):
    p = plan(s, C)
    feasible = [v for v in p.costs.values() if v is not None]
    assert all(math.isfinite(v) and v >= 0 for v in feasible)
    if p.action not in ("none", "partial"):
        assert p.costs[p.action] == min(feasible)
    expand = s.coefficients.get("expand_groups", C.expand_groups)
    if p.action == "offload":  # in expand steps, or all the headroom
        assert p.groups % expand == 0 or p.groups == s.offload.headroom_groups


@given(snapshots(), st.sampled_from(POLICIES))
def test_never_preempts_at_prefill(s, policy):
    s = Snapshot.from_json({**s.to_json(), "site": "prefill"})
    p = plan(s, C, policy)
    assert p.action != "preempt" and p.costs["preempt"] is None


@given(snapshots())
def test_eviction_cost_follows_the_trees_order(s):
    """The candidates come in the order the tree evicts them: the cost is that of the shortest
    prefix of the list that covers the gap, whatever cheaper nodes lie further down."""
    if s.gap_tokens <= 0:
        return  # nothing to cover: a 'none' plan
    c = s.coefficients_over(C)
    freed, expected = 0, 0.0
    for e in s.evictable:
        if freed >= s.gap_tokens:
            break
        freed += e.tokens
        expected += cached_block_cost_s(e.tokens, e.hits, e.age_steps, e.prior_hit_rate, c)
    got = plan(s, C).costs["evict"]
    if freed < s.gap_tokens:
        assert got is None
    else:
        assert got == pytest.approx(expected)


@given(snapshots())
def test_snapshot_json_round_trip(s):
    assert Snapshot.from_json(copy.deepcopy(s.to_json())) == s


# --- invalid snapshots ---------------------------------------------------------------------------
VALID = snap(300, EVICTABLE, preempt=PREEMPT).to_json()
BAD = [  # (path in the JSON, bad value, words the error must contain)
    (("site",), "both", "snapshot.site must be 'prefill' or 'decode'"),
    (("gap_tokens",), 1.5, "snapshot.gap_tokens must be an integer"),
    (("evictable", 1, "tokens"), 0, "snapshot.evictable[1].tokens must be a positive integer"),
    (("evictable", 0, "hits"), -1, "snapshot.evictable[0].hits must be a non-negative integer"),
    (("evictable", 2, "age_steps"), "old", "snapshot.evictable[2].age_steps must be a non-negative integer"),
    (("offload", "top_k"), 0, "snapshot.offload.top_k must be a positive integer"),
    (("offload", "tokens_by_groups"), [64] * 3, "tokens_by_groups must list one count per headroom group"),
    (("offload", "tokens_by_groups"), [64 * (10 - n) for n in range(10)], "tokens_by_groups must not decrease"),
    (("evictable", 0, "prior_hit_rate"), 2.0, "snapshot.evictable[0].prior_hit_rate must be a number in [0, 1]"),
    (("free_tokens",), -1, "snapshot.free_tokens must be a non-negative integer"),
    (("preempt", 0, "decode_tokens"), None, "snapshot.preempt[0].decode_tokens must be a non-negative integer"),
    (("offload", "headroom_groups"), True, "snapshot.offload.headroom_groups must be a non-negative integer"),
    (("preempt", 1, "tokens"), -3, "snapshot.preempt[1].tokens must be a non-negative integer"),
    (("observed_hit_rate",), 1.5, "snapshot.observed_hit_rate must be a number in [0, 1]"),
    (("observed_hit_rate",), float("nan"), "snapshot.observed_hit_rate must be a number in [0, 1]"),
    (("coefficients",), {"alpha": 3}, "snapshot.coefficients: --vamp-alpha must be in (0, 1]"),
    (("coefficients",), {"gamma": 3}, "snapshot.coefficients has unknown field 'gamma'"),
    (("coefficients",), {"expand_groups": 0}, "snapshot.coefficients.expand_groups must be a positive integer"),
    (("offload",), [], "snapshot.offload must be a JSON object"),
    (("evictable",), {}, "snapshot.evictable must be a JSON list"),
]


@pytest.mark.parametrize("path, value, message", BAD, ids=[".".join(map(str, b[0])) for b in BAD])
def test_invalid_snapshot_names_the_field(path, value, message):
    d = copy.deepcopy(VALID)
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(SnapshotError) as e:
        Snapshot.from_json(d)
    assert message in str(e.value)


def test_missing_and_unknown_fields_are_named():
    d = copy.deepcopy(VALID)
    del d["offload"]["decode_budget_min"]
    with pytest.raises(SnapshotError, match=r"snapshot\.offload\.decode_budget_min is missing"):
        Snapshot.from_json(d)
    with pytest.raises(SnapshotError, match=r"snapshot\.preempt\[0\] has unknown field 'priority'"):
        Snapshot.from_json({**VALID, "preempt": [{"partial_tokens": 1, "tokens": 2, "decode_tokens": 1,
                                                  "priority": 0}]})
    with pytest.raises(SnapshotError, match="snapshot must be a JSON object"):
        Snapshot.from_json([VALID])
    with pytest.raises(ValueError, match="policy must be one of"):
        plan(Snapshot.from_json(VALID), C, "lru")
