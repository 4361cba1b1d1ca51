"""The shortcuts that keep a decision cheap (issue 23) decide exactly what the long way does.

A snapshot's lists pass a one-pass check and only fall back to the field-by-field one when that
check fails (snapshot.py), the coefficient overrides are remembered (`_overridden`), and the
planner prices each candidate once per plan, only as far as some plan reads (`_Totals`). Each is
checked here against the long way: the same accepted snapshots, the same error messages, the same
coefficients, and the same whole plans (action, groups, tokens, all four float costs) and `explain` output as
a planner that walks the candidates one at a time for each plan (`slow_plan`), on random snapshots where every
action and every infeasible option turns up."""

import contextlib
import io
import json
import math
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vamp_sglang.policy import (
    POLICIES,
    Coefficients,
    EvictableBlock,
    OffloadState,
    Plan,
    PreemptCandidate,
    Snapshot,
    SnapshotError,
    combined_cost_s,
    offload_cost_s,
    plan,
    planner,
    preempt_cost_s,
)
from vamp_sglang.policy import __main__ as policy_cli
from vamp_sglang.policy import snapshot as snapshot_module

C = Coefficients()
OFFLOAD = OffloadState(3, (0, 64, 64), 2, 8, 2, 3)
ODD = st.sampled_from([0, -1, 1, 7, 0.0, 0.5, 1.0, -0.0, 2.0, math.nan, math.inf, True, False, None, "7", 10**20])


def outcome(check, *args):
    try:
        check(*args)
    except SnapshotError as e:
        return str(e)
    return "ok"


def built(**fields):
    base = {"site": "decode", "gap_tokens": 100, "free_tokens": 0, "evictable": (), "offload": OFFLOAD,
            "preempt": (), "retract_buffer_tokens": 4, "observed_hit_rate": 0.5}
    return outcome(lambda: Snapshot(**{**base, **fields}))


BLOCK_ROWS = st.lists(st.tuples(st.integers(1, 50), st.integers(0, 5), st.integers(0, 50), st.floats(0.0, 1.0),
                                st.sampled_from([None, 0, 3]), st.booleans()), max_size=4)
VICTIM_ROWS = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 2)), max_size=4)
LISTS = {"evictable": (BLOCK_ROWS, EvictableBlock, snapshot_module._validate_blocks),
         "preempt": (VICTIM_ROWS, PreemptCandidate, snapshot_module._validate_victims)}


@settings(max_examples=400)
@given(st.sampled_from(sorted(LISTS)).flatmap(lambda name: st.tuples(st.just(name), LISTS[name][0])),
       st.integers(0, 5), st.integers(0, 5), ODD)
def test_lists_are_accepted_and_refused_as_field_by_field(named_rows, row, field, odd):
    name, rows = named_rows
    _, record, field_by_field = LISTS[name]
    rows = [list(r) for r in rows]
    if rows:
        picked = rows[row % len(rows)]
        picked[field % len(picked)] = odd
    items = tuple(record(*r) for r in rows)
    assert built(**{name: items}) == outcome(field_by_field, items)


@settings(max_examples=300)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=5), st.integers(0, 5), ODD)
def test_gains_are_accepted_and_refused_as_field_by_field(gains, index, odd):
    gains[index % len(gains)] = odd
    offload = OffloadState(len(gains), tuple(gains), 2, 8, 2, 3)
    assert built(offload=offload) == outcome(snapshot_module._validate_gains, tuple(gains))


@pytest.mark.parametrize("overrides", [{"t_sched_us": 0.0}, {"t_sched_us": -0.0}, {"alpha": 1}, {"alpha": 1.0},
                                       {"expand_groups": 2}, Coefficients(alpha=0.25).as_overrides()])
def test_remembered_coefficients_are_what_with_overrides_builds(overrides):
    for base in (C, Coefficients(t_prefill_s=160e-6)):
        for _ in range(2):  # the second time from the memo
            got = Snapshot(site="decode", gap_tokens=1, free_tokens=0, evictable=(), offload=OFFLOAD, preempt=(),
                           retract_buffer_tokens=0, observed_hit_rate=0.5,
                           coefficients=overrides).coefficients_over(base)
            assert repr(got) == repr(base.with_overrides(overrides))  # repr: -0.0 stays -0.0


def test_bad_coefficients_are_refused_every_time():
    for _ in range(2):
        assert "snapshot.coefficients: --vamp-alpha must be in (0, 1]" in built(coefficients={"alpha": 3})


def test_validity_is_remembered_per_value_not_per_equal_value():
    """`_VALIDATED` keys by repr: True equals 1 and 1.0, but only the numbers are coefficients."""
    for _ in range(2):
        assert built(coefficients={"expand_groups": 1}) == "ok"
        assert built(coefficients={"alpha": 1.0}) == "ok"
        assert "snapshot.coefficients.expand_groups must be a positive integer" in built(coefficients={"expand_groups": True})
        assert "snapshot.coefficients.alpha must be a finite number" in built(coefficients={"alpha": True})


class SlowEviction:
    """The tree's eviction as the planner walked it before `_Totals`: one candidate at a time from the first,
    resumable (the preempt replay frees a little after each victim)."""

    def __init__(self, s, c):
        self.s, self.c, self.taken, self.freed, self.cost_s = s, c, 0, 0, 0.0

    def free(self, need_tokens):
        while self.freed < need_tokens and self.taken < len(self.s.evictable):
            block = self.s.evictable[self.taken]
            self.taken, self.freed = self.taken + 1, self.freed + block.tokens
            self.cost_s += planner.block_cost_s(self.s, block, self.c)
        return self.freed >= need_tokens


def slow_options(s, c):
    """The four candidate plans the long way, as the planner's docstring states them: {key: (cost_s, groups,
    evict_tokens) or None}. Each plan walks the candidates from the first with an eviction of its own."""
    most = s.offloadable_groups
    sizes = [g for g in range(1, most + 1) if g % c.expand_groups == 0 or g == most]
    covering = [g for g in sizes if s.offload_tokens(g) >= s.gap_tokens]
    floors = [g for g in sizes if s.offload_tokens(g) < s.gap_tokens]
    options = dict.fromkeys(planner.COST_KEYS)
    evict = SlowEviction(s, c)
    if evict.free(s.gap_tokens):
        options["evict"] = (evict.cost_s, 0, s.gap_tokens)
    if covering:
        options["offload"] = (offload_price(s, c, covering[0]), covering[0], 0)
    if floors and s.offload_tokens(floors[-1]):
        remainder = s.gap_tokens - s.offload_tokens(floors[-1])
        evict = SlowEviction(s, c)
        if evict.free(remainder):
            cost = combined_cost_s(offload_price(s, c, floors[-1]), evict.cost_s)
            options["combined"] = (cost, floors[-1], remainder)
    if s.site == "decode":  # retract_decode: one victim at a time, evicting to the buffer after each
        free, need, evict = s.free_tokens, s.gap_tokens + s.free_tokens, SlowEviction(s, c)
        for n, victim in enumerate(s.preempt, start=1):
            free, need = free + victim.tokens, need - victim.decode_tokens
            evict.free(max((len(s.preempt) + 1 - n) * s.retract_buffer_tokens, need) - free)
            if free + evict.freed >= need:
                partials = [v.partial_tokens for v in s.preempt[:n]]
                options["preempt"] = (preempt_cost_s(partials, c) + evict.cost_s, 0, 0)
                break
    return options


def offload_price(s, c, groups):
    o = s.offload
    return offload_cost_s(groups, o.shards_per_group, o.local_experts, o.top_k, o.decode_budget_min, c)


TIES = ("evict", "offload", "combined", "preempt")
STEPS = {"cost": [TIES], "evict-first": [("evict",), ("offload",), ("combined", "preempt")],
         "offload-first": [("offload",), ("combined",), ("evict",), ("preempt",)]}


def slow_plan(s, coeffs, policy):
    """The whole plan the long way: the cheapest feasible option of the policy's first step that has one."""
    c = s.coefficients_over(coeffs)
    if s.gap_tokens <= 0:
        return Plan("none", 0, 0, {key: None if key == "preempt" and s.site == "prefill" else 0.0
                                   for key in planner.COST_KEYS})
    options = slow_options(s, c)
    costs = {key: None if option is None else option[0] for key, option in options.items()}
    for step in STEPS[policy]:
        feasible = sorted((options[key][0], TIES.index(key), key) for key in step if options[key] is not None)
        if feasible:
            action = feasible[0][2]
            return Plan(action, options[action][1], options[action][2], costs)
    return Plan("partial", s.offloadable_groups, sum(e.tokens for e in s.evictable), costs)


def explained(s, policy, *flags):
    """What `python -m vamp_sglang.policy explain` prints for `s` (in process, from a file as a user's)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "snapshot.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(s.to_json(), f)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert policy_cli.main(["explain", path, "--policy", policy, *flags]) == 0
    return out.getvalue()


BLOCKS = st.builds(EvictableBlock, st.integers(1, 64), st.integers(0, 5), st.integers(0, 3000),
                   st.floats(0.0, 1.0), st.sampled_from([None, 0, 3]), st.booleans())
VICTIMS = st.builds(PreemptCandidate, st.integers(0, 50), st.integers(0, 200), st.integers(0, 2))


@st.composite
def snapshots(draw):
    """Snapshots on which every action and every infeasible option turn up: headroom 0-9 with gains that may
    start at 0, candidates with and without host copies, victims whose buffers make the replay evict again,
    and gaps on the edges, where an offload or the candidates cover them exactly (or with the offload
    floor)."""
    blocks = draw(st.lists(BLOCKS, max_size=10))
    headroom = draw(st.integers(0, 9))
    gains = sorted(draw(st.lists(st.integers(0, 300), min_size=headroom, max_size=headroom)))
    covers = [sum(e.tokens for e in blocks[:n]) for n in range(len(blocks) + 1)]
    edges = st.builds(lambda g, c, d: g + c + d, st.sampled_from([0, *gains]), st.sampled_from(covers),
                      st.integers(-1, 1))
    host_load = draw(st.sampled_from([None, None, 0.3]))
    return Snapshot(site=draw(st.sampled_from(["prefill", "decode"])),
                    gap_tokens=draw(st.one_of(st.integers(-2, 400), edges)),
                    free_tokens=draw(st.integers(0, 20)), evictable=tuple(blocks),
                    offload=OffloadState(headroom, tuple(gains), 2, 8, 2, draw(st.integers(0, 4))),
                    preempt=tuple(draw(st.lists(VICTIMS, max_size=4))),
                    retract_buffer_tokens=draw(st.integers(0, 30)), observed_hit_rate=0.5,
                    coefficients=draw(st.sampled_from([{}, {}, {"expand_groups": 1}, {"expand_groups": 3}])),
                    tpot_guard_groups=draw(st.sampled_from([None, None, 0, 2, 5])),
                    host_load_us_per_token=host_load,
                    host_write_back=host_load is not None and draw(st.booleans()))


def hand_built(gap, site="decode", blocks=(), headroom=0, gains=(), victims=(), buffer=0):
    return Snapshot(site=site, gap_tokens=gap, free_tokens=0, evictable=tuple(blocks),
                    offload=OffloadState(headroom, tuple(gains), 2, 8, 2, 3), preempt=tuple(victims),
                    retract_buffer_tokens=buffer, observed_hit_rate=0.5)


FIFTY = [EvictableBlock(50, 1, 10, 0.5)] * 4
HOT = [EvictableBlock(500, 5, 0, 1.0)] * 4  # dearer to evict than offloading 4 groups
# One snapshot per action, checked on every run whatever hypothesis draws. In "evict@exact-cover" (the
# report's) and "combined", evict prices three blocks, then combined reads the first two: an exact cover of
# its remainder.
# "preempt@replay": the first victim's eviction runs out of candidates, the second asks for less.
EXAMPLES = {"none": hand_built(0), "evict": hand_built(120, blocks=FIFTY[:3]),
            "evict@exact-cover": hand_built(120, blocks=FIFTY, headroom=4, gains=(5, 10, 15, 20)),
            "offload": hand_built(60, headroom=4, gains=(10, 20, 40, 80)),
            "combined": hand_built(1200, blocks=HOT, headroom=4, gains=(50, 100, 150, 200)),
            "preempt": hand_built(40, victims=[PreemptCandidate(0, 45, 1)]),
            "preempt@replay": hand_built(100, blocks=[EvictableBlock(30, 5, 0, 1.0)] * 2,
                                         victims=[PreemptCandidate(0, 10, 1), PreemptCandidate(0, 70, 1)]),
            "partial": hand_built(500, site="prefill", blocks=FIFTY, headroom=4, gains=(10, 20, 40, 80))}


def check_against_the_slow_path(s, policy):
    """Action, groups, tokens, all four costs (None where infeasible), and what `explain` prints of them."""
    fast, slow = plan(s, C, policy), slow_plan(s, C, policy)
    assert fast.to_json() == slow.to_json()
    assert explained(s, policy) == policy_cli._describe(slow, s, policy) + "\n"
    assert json.loads(explained(s, policy, "--json")) == slow.to_json()
    return fast


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_hand_built_example_takes_its_action_as_the_slow_path_does(name):
    assert check_against_the_slow_path(EXAMPLES[name], "cost").action == name.split("@")[0]
    for policy in POLICIES:
        check_against_the_slow_path(EXAMPLES[name], policy)


@settings(max_examples=500, deadline=None)
@given(snapshots(), st.sampled_from(POLICIES))
def test_whole_plans_and_explain_output_are_the_slow_paths(s, policy):
    check_against_the_slow_path(s, policy)


def test_only_the_candidates_a_plan_reads_are_priced(monkeypatch):
    priced = []
    cost = planner.block_cost_s
    monkeypatch.setattr(planner, "block_cost_s", lambda s, e, c: priced.append(e) or cost(s, e, c))
    blocks = tuple(EvictableBlock(100, 1, 10, 0.5) for _ in range(50))
    s = Snapshot(site="prefill", gap_tokens=250, free_tokens=0, evictable=blocks, offload=OFFLOAD, preempt=(),
                 retract_buffer_tokens=0, observed_hit_rate=0.5)
    p = plan(s, C)
    assert p.costs["evict"] is not None and len(priced) == 3  # evict and combined share the first three
