"""The decision prices the host tier (issue 22): evicting a prefix HiCache holds a host copy of costs its load
(Eq. 2 with n_tok * t_load in place of n_tok * t_prefill, times p_eff); without a copy, Eq. 2 as before. The
snapshot says per candidate whether it has a copy and carries the agreed load time per token; `explain` shows
the term and the log records it."""

import json

import pytest

from vamp_sglang.policy import Coefficients
from vamp_sglang.policy import __main__ as policy_main
from vamp_sglang.policy.costs import cached_block_cost_s, host_copy_block_cost_s
from vamp_sglang.policy.planner import plan
from vamp_sglang.policy.snapshot import EvictableBlock, OffloadState, Snapshot, SnapshotError

C = Coefficients()
LOAD_S = 1e-7  # 0.1 us per token: 150x cheaper than the default 15 us re-prefill


def _snapshot(host_copy, load_us=LOAD_S * 1e6, gap=100):
    blocks = (EvictableBlock(2000, 3, 10, 0.5, host_copy=host_copy),)
    return Snapshot(site="prefill", gap_tokens=gap, free_tokens=0, evictable=blocks,
                    offload=OffloadState(1, (400,), 8, 128, 8, 16), preempt=(), retract_buffer_tokens=0,
                    observed_hit_rate=0.5, host_load_us_per_token=load_us)


def test_a_host_copy_prices_the_load_in_place_of_the_re_prefill():
    with_copy = plan(_snapshot(True), C).costs["evict"]
    without = plan(_snapshot(False), C).costs["evict"]
    assert with_copy == pytest.approx(host_copy_block_cost_s(2000, 3, 10, 0.5, LOAD_S, C))
    assert without == pytest.approx(cached_block_cost_s(2000, 3, 10, 0.5, C))
    assert with_copy < without


def test_a_host_copy_can_turn_an_offload_into_an_eviction():
    assert plan(_snapshot(False), C).action == "offload"
    assert plan(_snapshot(True), C).action == "evict"


def test_without_a_measured_load_rate_a_copy_is_priced_as_before():
    assert plan(_snapshot(True, load_us=None), C).costs["evict"] == pytest.approx(plan(_snapshot(False), C).costs["evict"])


def test_the_json_round_trips_and_omits_the_defaults():
    s = _snapshot(True)
    d = s.to_json()
    assert d["evictable"][0]["host_copy"] is True and d["host_load_us_per_token"] == pytest.approx(0.1)
    assert Snapshot.from_json(json.loads(json.dumps(d))) == s
    plain = _snapshot(False, load_us=None).to_json()
    assert "host_copy" not in plain["evictable"][0] and "host_load_us_per_token" not in plain


@pytest.mark.parametrize("field,value", [("host_copy", 1), ("host_copy", "yes")])
def test_bad_host_copy_is_named(field, value):
    d = _snapshot(False).to_json()
    d["evictable"][0][field] = value
    with pytest.raises(SnapshotError, match=r"snapshot.evictable\[0\].host_copy"):
        Snapshot.from_json(d)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "fast"])
def test_bad_load_rate_is_named(value):
    d = _snapshot(False).to_json()
    d["host_load_us_per_token"] = value
    with pytest.raises(SnapshotError, match="snapshot.host_load_us_per_token"):
        Snapshot.from_json(d)


def test_explain_shows_the_host_copy_term(tmp_path, capsys):
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(_snapshot(True).to_json()))
    assert policy_main.main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "host copy" in out and "1 of 1 candidates" in out and "0.1 us/token" in out


class _Rounds:
    def __init__(self, several, others=(), missed=False):
        self.several, self.others, self.missed, self.calls = several, others, missed, 0

    def agree(self, value, fallback=0, purpose=""):
        self.calls += 1
        return fallback if self.missed else min((value, *self.others))


def _inputs(rounds, step=[0]):  # noqa: B006 (the test moves the step)
    from vamp_sglang.integration.decisions.plan_inputs import PlanInputs

    inputs = PlanInputs.__new__(PlanInputs)
    inputs.rounds, inputs.step_fn, inputs._host_load = rounds, lambda: step[0], None
    return inputs, step


def _tier(us):
    from types import SimpleNamespace

    return SimpleNamespace(load_s_per_token=None if us is None else us / 1e6)


def test_one_rank_prices_its_own_measurement_and_none_without_hicache():
    inputs, _ = _inputs(_Rounds(False))
    assert inputs.host_load_us_per_token(_tier(0.25)) == pytest.approx(0.25)
    assert inputs.host_load_us_per_token(None) is None and inputs.host_load_us_per_token(_tier(None)) is None


def test_tp_ranks_price_the_agreed_minimum_re_agreed_every_256_steps():
    from vamp_sglang.integration.decisions.plan_inputs import COEFFICIENT_AGREE_STEPS

    rounds = _Rounds(True, others=(200_000,))  # the other rank measured 0.2 us/token (picoseconds)
    inputs, step = _inputs(rounds, [0])
    assert inputs.host_load_us_per_token(_tier(0.5)) == pytest.approx(0.2)
    step[0] = COEFFICIENT_AGREE_STEPS - 1
    assert inputs.host_load_us_per_token(_tier(0.9)) == pytest.approx(0.2) and rounds.calls == 1
    step[0] = COEFFICIENT_AGREE_STEPS
    rounds.others = (900_000,)
    assert inputs.host_load_us_per_token(_tier(0.4)) == pytest.approx(0.4) and rounds.calls == 2


def test_a_missed_round_prices_evictions_as_re_prefills():
    inputs, _ = _inputs(_Rounds(True, missed=True))
    assert inputs.host_load_us_per_token(_tier(0.5)) is None


def test_under_write_back_an_eviction_without_a_copy_costs_the_write_then_the_load():
    import dataclasses

    s = dataclasses.replace(_snapshot(False), host_write_back=True)
    write = 2000 * LOAD_S
    assert plan(s, C).costs["evict"] == pytest.approx(write + host_copy_block_cost_s(2000, 3, 10, 0.5, LOAD_S, C))
    assert plan(dataclasses.replace(_snapshot(True), host_write_back=True), C).costs["evict"] == pytest.approx(
        plan(_snapshot(True), C).costs["evict"])  # a copy that exists is not written again
    assert Snapshot.from_json(json.loads(json.dumps(s.to_json()))) == s and s.to_json()["host_write_back"] is True
    d = s.to_json()
    d["host_write_back"] = "yes"
    with pytest.raises(SnapshotError, match="snapshot.host_write_back"):
        Snapshot.from_json(d)
