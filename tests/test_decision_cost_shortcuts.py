"""The shortcuts that keep a decision cheap (issue 23) decide exactly what the long way does.

A snapshot's lists pass a one-pass check and only fall back to the field-by-field one when that
check fails (snapshot.py), the coefficient overrides are remembered (`_overridden`), and the
planner prices each candidate once per plan, only as far as some plan reads (`_Totals`). Each is
checked here against the long way: the same accepted snapshots, the same error messages, the same
coefficients and the same float costs."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vamp_sglang.policy import (
    Coefficients,
    EvictableBlock,
    OffloadState,
    PreemptCandidate,
    Snapshot,
    SnapshotError,
    plan,
    planner,
)
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


def sequential_evict_cost(s, c):
    """The eviction cost one block at a time, as the planner summed it before `_Totals`."""
    freed, cost = 0, 0.0
    for e in s.evictable:
        if freed >= s.gap_tokens:
            break
        freed += e.tokens
        cost += planner.block_cost_s(s, e, c)
    return cost if freed >= s.gap_tokens else None


@settings(max_examples=300)
@given(st.lists(st.builds(EvictableBlock, st.integers(1, 500), st.integers(0, 50), st.integers(0, 10**5),
                          st.floats(0.0, 1.0), st.sampled_from([None, 0, 40]), st.booleans()), max_size=12),
       st.integers(1, 3000), st.sampled_from([None, 0.3]), st.booleans())
def test_eviction_costs_are_the_sequential_sums_exactly(blocks, gap, host_load, write_back):
    s = Snapshot(site="prefill", gap_tokens=gap, free_tokens=0, evictable=tuple(blocks),
                 offload=OffloadState(0, (), 0, 8, 2, 3), preempt=(), retract_buffer_tokens=0, observed_hit_rate=0.5,
                 host_load_us_per_token=host_load, host_write_back=write_back)
    assert plan(s, C).costs["evict"] == sequential_evict_cost(s, C)


def test_only_the_candidates_a_plan_reads_are_priced(monkeypatch):
    priced = []
    cost = planner.block_cost_s
    monkeypatch.setattr(planner, "block_cost_s", lambda s, e, c: priced.append(e) or cost(s, e, c))
    blocks = tuple(EvictableBlock(100, 1, 10, 0.5) for _ in range(50))
    s = Snapshot(site="prefill", gap_tokens=250, free_tokens=0, evictable=blocks, offload=OFFLOAD, preempt=(),
                 retract_buffer_tokens=0, observed_hit_rate=0.5)
    p = plan(s, C)
    assert p.costs["evict"] is not None and len(priced) == 3  # evict and combined share the first three
