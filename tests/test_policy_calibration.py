"""Online calibration and the decision log (pure Python)."""

import json

import pytest

from vamp_sglang.policy import Coefficients, Snapshot, plan
from vamp_sglang.policy.__main__ import main as explain_main
from vamp_sglang.policy.calibration import MIN_PREFILL_TOKENS, SMOOTHING, Calibrator
from vamp_sglang.policy.decision_log import DecisionLog

SNAPSHOT = {
    "site": "decode", "gap_tokens": 300, "free_tokens": 0,
    "evictable": [{"tokens": 200, "hits": 0, "age_steps": 10, "prior_hit_rate": 0.5},
                  {"tokens": 400, "hits": 5, "age_steps": 1, "prior_hit_rate": 0.5}],
    "offload": {"headroom_groups": 8, "tokens_by_groups": [100 * n for n in range(1, 9)], "shards_per_group": 2,
                "local_experts": 128, "top_k": 2, "decode_budget_min": 16},
    "preempt": [{"partial_tokens": 20, "tokens": 500, "decode_tokens": 1}],
    "retract_buffer_tokens": 20,
    "observed_hit_rate": 0.5,
}


def test_falls_back_to_configured_values_until_measured():
    base = Coefficients()
    assert Calibrator().apply(base, top_k=2, local_experts=128) == base


def test_prefill_measurement_replaces_paper_value_and_smooths():
    cal = Calibrator()
    cal.observe_prefill(100, 0.016)  # 160 us per token, as measured on this CPU
    assert cal.apply(Coefficients(), 2, 128).t_prefill_s == pytest.approx(160e-6)
    cal.observe_prefill(100, 0.006)  # 60 us: moves by SMOOTHING of the difference
    assert cal.t_prefill_s == pytest.approx(160e-6 + SMOOTHING * (60e-6 - 160e-6))
    cal.observe_prefill(MIN_PREFILL_TOKENS - 1, 10.0)  # tiny batches are fixed overhead: ignored
    assert cal.prefill_samples == 2


def test_staging_measurement_sets_c_reload_through_c_eff():
    cal = Calibrator()
    cal.observe_staging(offloaded_shards=16, wait_s=16 * 5e-6)  # 5 us per shard per step
    c = cal.apply(Coefficients(), top_k=2, local_experts=128)
    assert c.c_reload_s * 2 / 128 == pytest.approx(5e-6)  # c_eff = c_reload * k / E (Eq. 3)


def test_calibrated_t_prefill_changes_the_decision():
    """With the paper's 15 us eviction looks cheap; with a CPU's 160 us the same gap offloads."""
    # C_e = 16 shards * c_eff (0.63 ms * 8 / 64 = 78.75 us) * w 64 = 80.6 ms at either t_prefill.
    offload = {"headroom_groups": 8, "tokens_by_groups": [100 * n for n in range(1, 9)], "shards_per_group": 4,
               "local_experts": 64, "top_k": 8, "decode_budget_min": 64}
    snap = Snapshot.from_json({**SNAPSHOT, "site": "prefill", "preempt": [], "offload": offload})
    paper = plan(snap, Coefficients())
    cal = Calibrator()
    cal.observe_prefill(1000, 0.9)  # 900 us per token
    slow = plan(snap, cal.apply(Coefficients(), 8, 64))
    assert paper.action == "evict" and slow.action == "offload"
    assert paper.costs["offload"] == pytest.approx(slow.costs["offload"])


def test_decision_log_ring_file_and_explain_round_trip(tmp_path, capsys):
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(capacity=2, path=str(path))
    snap = Snapshot.from_json(SNAPSHOT)
    chosen = plan(snap, Coefficients())
    for step in range(3):
        log.record(step=step, site="decode", policy="cost", snapshot=snap, plan=chosen,
                   decide_s=0.001, outcome={"tokens_added": 0, "covered": True})
    log.close()
    recent = log.recent()
    assert [r["step"] for r in recent] == [1, 2]  # bounded ring
    assert "snapshot" not in recent[0] and recent[0]["candidates"] == {"evictable": 2, "preempt": 1}
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["snapshot"]["gap_tokens"] == 300
    assert explain_main(["explain", "--json", str(path), "--line", "1"]) in (0, None)
    assert json.loads(capsys.readouterr().out)["action"] == chosen.action
