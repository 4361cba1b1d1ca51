"""What speculative decoding changes in VAMP's pricing and stats, without SGLang (issue 46).

- A busy restore leaves free, per running request, SGLang's retraction buffer and, with a draft, the rows its
  next draft and verify take ahead (`decode_reserve_tokens`, SGLang's `get_alloc_reserve_per_decode`: twice
  the draft tokens): a restore that left only the former would be undone by the very next step's shortfall.
- Eq. 3 spreads a verify step's staging over the accept length (an EMA of SGLang's committed tokens per verify),
  and the configured t_prefill of Eqs. 2 and 4 covers the draft's extend over the re-prefilled tokens.
- `/vamp/stats` `speculation` reports SGLang's mean accept length over the lifetime totals and the window its
  metrics reporter has not logged yet.
"""

import dataclasses
from types import SimpleNamespace

import pytest

from vamp_sglang.integration.memory.draft_pools import SpeculationStats
from vamp_sglang.policy.restore import RestoreState, decode_reserve_tokens, plan_restore

RETRACT_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS's default
DRAFT_RESERVE = 8  # get_alloc_reserve_per_decode with --speculative-num-draft-tokens 4


def test_the_decode_reservation_covers_the_draft_tokens():
    assert decode_reserve_tokens(3, RETRACT_STEPS) == 60
    assert decode_reserve_tokens(3, RETRACT_STEPS, DRAFT_RESERVE) == 84
    assert decode_reserve_tokens(0, RETRACT_STEPS, DRAFT_RESERVE) == 0


def test_a_calm_restore_that_fits_only_without_the_draft_reserve_waits():
    """Four running requests, a smaller pool keeping 90 rows past those in use: enough for the retraction
    buffer (80), not for it and the draft tokens (112), and a calm restore never evicts to make room."""
    def state(reserve_tokens):
        return RestoreState(idle=False, idle_s=0.0, calm_steps=50, tpot_over_slo=False, restore_after_steps=20,
                            offloaded_groups=2, expand_groups=1, pool_tokens=1000, keep_tokens=600, used_tokens=510,
                            evictable_tokens=100, baseline_tokens=500, tail_free=True, can_compact=True,
                            reserve_tokens=reserve_tokens)

    plain = plan_restore(state(decode_reserve_tokens(4, RETRACT_STEPS)))
    spec = plan_restore(state(decode_reserve_tokens(4, RETRACT_STEPS, DRAFT_RESERVE)))
    assert (plain.groups, plain.evict_tokens) == (1, 0)
    assert spec.groups == 0 and "never evicts" in spec.reason


def test_the_accept_length_counts_the_window_not_logged_yet():
    reporter = SimpleNamespace(spec_total_num_accept_tokens=30, spec_total_num_forward_ct=10,
                               spec_num_accept_tokens=9, spec_num_forward_ct=3)
    scheduler = SimpleNamespace(metrics_reporter=reporter, spec_algorithm=SimpleNamespace(name="EAGLE"))
    assert SpeculationStats(scheduler).stats() == {
        "speculation": {"algorithm": "EAGLE", "verify_steps": 13, "accept_length": 3.0}}
    reporter.spec_total_num_forward_ct = reporter.spec_num_forward_ct = 0
    assert SpeculationStats(scheduler).stats()["speculation"]["accept_length"] is None


# --- the decision prices what speculation changes (paper IV-B, Eqs. 2-4) ---------------------------------------
def _offload_only_snapshot(accept_length: float, budget: int = 40, evict_tokens: int = 64):
    """A decode gap of 50 tokens that 4 offloaded groups cover, or evicting one cached 64-token block."""
    from vamp_sglang.policy.snapshot import EvictableBlock, OffloadState, Snapshot

    block = EvictableBlock(tokens=evict_tokens, hits=3, age_steps=0, prior_hit_rate=0.9)
    offload = OffloadState(headroom_groups=4, tokens_by_groups=(20, 40, 60, 80), shards_per_group=4,
                           local_experts=64, top_k=8, decode_budget_min=budget, accept_length=accept_length)
    return Snapshot(site="prefill", gap_tokens=50, free_tokens=0, evictable=(block,), offload=offload, preempt=(),
                    retract_buffer_tokens=20, observed_hit_rate=0.5)


def test_eq3_spreads_a_steps_staging_over_the_accepted_tokens():
    """A verify step stages the offloaded experts once and commits `accept_length` tokens, so w of Eq. 3 (the
    steps the cost is paid over) is the smallest decode budget over the accept length, still 1..64 steps."""
    from vamp_sglang.policy.costs import Coefficients, offload_cost_s

    c = Coefficients()
    plain = offload_cost_s(4, 4, 64, 8, 30, c)
    assert offload_cost_s(4, 4, 64, 8, 30, c, accept_length=3.0) == pytest.approx(plain / 3)
    assert offload_cost_s(4, 4, 64, 8, 30, c, accept_length=1.0) == plain
    # 2 tokens left: one step all the same; 1,000 left: the 64-step horizon either way
    assert offload_cost_s(4, 4, 64, 8, 2, c, accept_length=3.0) == offload_cost_s(4, 4, 64, 8, 1, c)
    assert offload_cost_s(4, 4, 64, 8, 1000, c, accept_length=3.0) == offload_cost_s(4, 4, 64, 8, 1000, c)
    with pytest.raises(ValueError, match="accept_length"):
        offload_cost_s(4, 4, 64, 8, 30, c, accept_length=0.5)


def test_the_planner_offloads_where_the_accept_length_makes_staging_cheaper_than_a_re_prefill():
    from vamp_sglang.policy.costs import Coefficients
    from vamp_sglang.policy.planner import plan

    c = Coefficients(t_prefill_s=4e-6, c_reload_s=7.5e-6)  # offload 6.0e-4 s at a = 1, evict 3.7e-4
    plain, spec = plan(_offload_only_snapshot(1.0), c), plan(_offload_only_snapshot(3.2), c)
    assert plain.action == "evict" and spec.action == "offload"
    assert spec.costs["offload"] == pytest.approx(plain.costs["offload"] * 40 / 3.2 / 40)
    assert spec.costs["evict"] == plain.costs["evict"]


def test_a_snapshot_keeps_its_accept_length_and_reads_logs_without_one():
    from vamp_sglang.policy.snapshot import Snapshot, SnapshotError

    spec = _offload_only_snapshot(2.5)
    assert Snapshot.from_json(spec.to_json()) == spec and spec.to_json()["offload"]["accept_length"] == 2.5
    plain = _offload_only_snapshot(1.0).to_json()
    assert "accept_length" not in plain["offload"]  # logs without a draft stay as they were
    assert Snapshot.from_json(plain).offload.accept_length == 1.0
    plain["offload"]["accept_length"] = 0.5
    with pytest.raises(SnapshotError, match="snapshot.offload.accept_length"):
        Snapshot.from_json(plain)


def test_the_accept_length_is_a_moving_average_of_each_windows_tokens_per_verify():
    from vamp_sglang.policy.costs import AcceptLengthEstimator

    est = AcceptLengthEstimator()
    assert est.value == 1.0  # before the first verify: no spreading
    assert est.observe(accepted_tokens=30, verifies=10) == 3.0  # the first window is taken whole
    assert est.observe(30, 10) == 3.0  # no verify since: unchanged
    assert est.observe(40, 20) == pytest.approx(0.8 * 3.0 + 0.2 * 1.0)  # 10 tokens over 10 verifies


def test_the_accept_length_survives_sglangs_flush_cache():
    """POST /flush_cache zeroes SGLang's accept totals (reset_metrics, metrics_reporter.py:708-715): the
    estimate stays and the next window counts from the totals read after the flush."""
    from vamp_sglang.policy.costs import AcceptLengthEstimator

    est = AcceptLengthEstimator()
    assert est.observe(30_000, 10_000) == 3.0
    assert est.observe(40, 10) == 3.0  # the flush and 10 verifies since: a window that starts here
    assert est.observe(40 + 20, 10 + 10) == pytest.approx(0.8 * 3.0 + 0.2 * 2.0)  # 20 tokens over 10 verifies


def test_a_flush_the_totals_outgrew_before_the_next_reading_is_dropped_not_priced():
    """A flush seen only after the new totals passed the old ones mixes the two: (1100, 1000), then 2100
    tokens over 1010 verifies since the flush, reads as 1000 tokens over 10 verifies (100 a verify). No verify
    commits more than its draft tokens, so such a window crossed a reset: it restarts, the estimate stays."""
    from vamp_sglang.policy.costs import AcceptLengthEstimator

    est = AcceptLengthEstimator()
    assert est.observe(1100, 1000, most_per_verify=4) == pytest.approx(1.1)
    assert est.observe(2100, 1010, most_per_verify=4) == pytest.approx(1.1)
    after = 0.8 * 1.1 + 0.2 * 3.0
    assert est.observe(2100 + 30, 1010 + 10, most_per_verify=4) == pytest.approx(after)
    assert est.observe(2130 + 40, 1020 + 10, most_per_verify=4) == pytest.approx(0.8 * after + 0.2 * 4.0)


def test_a_re_prefill_with_a_draft_also_runs_the_draft_extend():
    """The configured t_prefill (Eqs. 2, 4) is the target's; SGLang's EAGLE worker runs the draft's extend over
    the same tokens in the same prefill batch, so a re-prefill costs (1 + draft layers / target layers) of it."""
    from vamp_sglang.policy.costs import draft_prefill_s

    assert draft_prefill_s(15e-6, draft_layers=1, target_layers=61) == pytest.approx(15e-6 * 62 / 61)
    assert draft_prefill_s(15e-6, 0, 61) == 15e-6
    with pytest.raises(ValueError):
        draft_prefill_s(15e-6, 1, 0)


def _inputs(draft_layers, calibrated=None, calibrate=True):
    from vamp_sglang.config import VampConfig
    from vamp_sglang.integration.decisions.plan_inputs import PlanInputs
    from vamp_sglang.policy.costs import Coefficients

    memory = SimpleNamespace(layout=SimpleNamespace(local_experts=64), pool=SimpleNamespace(
        pool=SimpleNamespace(layer_num=61)), draft_pools=[SimpleNamespace(pool=SimpleNamespace(layer_num=n))
                                                          for n in draft_layers])
    rounds = SimpleNamespace(several=False)
    calibrator = SimpleNamespace(apply=lambda base, k, e: base if calibrated is None else
                                 dataclasses.replace(base, t_prefill_s=calibrated))
    return PlanInputs(memory, rounds, VampConfig(calibrate=calibrate), SimpleNamespace(guard=None,
                      calibrator=calibrator), Coefficients(), lambda: 0, 8)


def test_plan_inputs_price_the_draft_extend_until_a_prefill_is_measured():
    """Before calibration the configured t_prefill grows by the draft's share; a measured one (timed around
    SGLang's run_batch, whose prefill runs the target and then the draft extend) already holds it."""
    from vamp_sglang.policy.costs import Coefficients

    base = Coefficients().t_prefill_s
    assert _inputs([]).coefficients().t_prefill_s == base
    assert _inputs([1]).coefficients().t_prefill_s == pytest.approx(base * 62 / 61)
    assert _inputs([1], calibrate=False).coefficients().t_prefill_s == pytest.approx(base * 62 / 61)
    assert _inputs([1], calibrated=2e-4).coefficients().t_prefill_s == 2e-4


@pytest.fixture()
def resolved_draft_tokens(monkeypatch):
    """SGLang's resolved speculative settings (runtime_context.get_spec, published in a server process): 4 draft
    tokens, SGLang's automatic chain, while ServerArgs keeps the raw input (None) when the flag is not given."""
    from sglang.srt import runtime_context

    monkeypatch.setattr(runtime_context, "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=4,
                                                                            max_speculative_num_draft_tokens=None))


def test_plan_inputs_read_the_accept_length_from_sglangs_counters(resolved_draft_tokens):
    reporter = SimpleNamespace(spec_total_num_accept_tokens=0, spec_total_num_forward_ct=0,
                               spec_num_accept_tokens=0, spec_num_forward_ct=0)
    spec = SimpleNamespace(metrics_reporter=reporter, spec_algorithm=SimpleNamespace(is_none=lambda: False),
                           server_args=SimpleNamespace(speculative_num_draft_tokens=None))
    plain = SimpleNamespace(spec_algorithm=SimpleNamespace(is_none=lambda: True))
    inputs = _inputs([1])
    assert inputs.accept_length(plain) == 1.0 and inputs.accept_length(spec) == 1.0
    reporter.spec_num_accept_tokens, reporter.spec_num_forward_ct = 32, 10
    assert inputs.accept_length(spec) == pytest.approx(3.2)
    # SGLang's logger moves the window into the totals: the sums, and so the average, do not change
    reporter.spec_total_num_accept_tokens, reporter.spec_total_num_forward_ct = 32, 10
    reporter.spec_num_accept_tokens = reporter.spec_num_forward_ct = 0
    assert inputs.accept_length(spec) == pytest.approx(3.2)
    # POST /flush_cache: SGLang's reset_metrics zeroes totals and window; a decision still prices with 3.2
    reporter.spec_total_num_accept_tokens = reporter.spec_total_num_forward_ct = 0
    assert inputs.accept_length(spec) == pytest.approx(3.2)
    reporter.spec_num_accept_tokens, reporter.spec_num_forward_ct = 20, 10
    assert inputs.accept_length(spec) == pytest.approx(0.8 * 3.2 + 0.2 * 2.0)
    # a flush the totals outgrew before this reading: 1,000 tokens over 10 verifies is more than 4 a verify
    reporter.spec_total_num_accept_tokens, reporter.spec_total_num_forward_ct = 1020, 30
    assert inputs.accept_length(spec) == pytest.approx(0.8 * 3.2 + 0.2 * 2.0)


def test_under_adaptive_speculation_a_window_past_the_current_width_is_priced(monkeypatch):
    """--speculative-adaptive rewrites the resolved draft-token count to the current width at every switch
    (eagle_worker_v2.py:1901-1906; narrower as batches grow, adaptive_spec_params.py:28-50), so a window that
    spans a switch from 4 to 2 commits more a verify than the current width: it is a real window, bounded by
    the largest width (runtime_context.max_speculative_num_draft_tokens), not a flush to drop."""
    from sglang.srt import runtime_context

    monkeypatch.setattr(runtime_context, "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=2,
                                                                            max_speculative_num_draft_tokens=8))
    reporter = SimpleNamespace(spec_total_num_accept_tokens=0, spec_total_num_forward_ct=0,
                               spec_num_accept_tokens=32, spec_num_forward_ct=10)
    spec = SimpleNamespace(metrics_reporter=reporter, spec_algorithm=SimpleNamespace(is_none=lambda: False))
    assert _inputs([1]).accept_length(spec) == pytest.approx(3.2)
