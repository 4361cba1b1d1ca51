"""`python -m vamp_sglang.policy explain` run as a user would: on a snapshot file and on a JSONL log."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
US = 1e-6

SNAPSHOT = {  # the worked example of test_policy_planner.py (costs computed there by hand)
    "site": "decode", "gap_tokens": 300, "free_tokens": 0, "observed_hit_rate": 0.3,
    "evictable": [{"tokens": 150, "hits": 0, "age_steps": 4000, "prior_hit_rate": 0.3},
                  {"tokens": 64, "hits": 1, "age_steps": 100, "prior_hit_rate": 0.3},
                  {"tokens": 200, "hits": 5, "age_steps": 10, "prior_hit_rate": 0.3}],
    "offload": {"headroom_groups": 10, "tokens_by_groups": [64 * n for n in range(1, 11)], "shards_per_group": 3,
                "local_experts": 512, "top_k": 10, "decode_budget_min": 100},
    "preempt": [{"partial_tokens": 100, "tokens": 180, "decode_tokens": 1},
                {"partial_tokens": 40, "tokens": 200, "decode_tokens": 1}],
    "retract_buffer_tokens": 0,
}
# Hot 4,000-token session prefixes: offloading 4 groups (9.45 ms) beats evicting one (~30 ms).
HOT = {**SNAPSHOT, "gap_tokens": 256, "observed_hit_rate": 0.9,
       "evictable": [{"tokens": 4000, "hits": 50, "age_steps": 0, "prior_hit_rate": 0.9}] * 4, "preempt": []}


def explain(*args):
    return subprocess.run([sys.executable, "-m", "vamp_sglang.policy", "explain", *map(str, args)],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_json_output_on_a_snapshot_file(tmp_path):
    f = tmp_path / "snapshot.json"
    f.write_text(json.dumps(SNAPSHOT, indent=2))
    r = explain("--json", f)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert list(out) == ["action", "groups", "evict_tokens", "costs"]
    assert (out["action"], out["groups"], out["evict_tokens"]) == ("evict", 0, 300)
    assert list(out["costs"]) == ["evict", "offload", "preempt", "combined"]
    assert out["costs"]["offload"] == pytest.approx(18900 * US)  # 24 shards * 12.3046875 us * 64
    assert out["costs"]["preempt"] == pytest.approx(3137.5 * US)  # one victim + the tree's cheapest node
    assert out["costs"]["combined"] == pytest.approx(9587.5 * US)


def test_human_output_names_the_plan_and_every_cost(tmp_path):
    f = tmp_path / "snapshot.json"
    f.write_text(json.dumps({**HOT, "site": "prefill"}))
    r = explain(f)
    assert r.returncode == 0, r.stderr
    assert "plan: offload: offload 4 expert groups (+256 KV tokens)" in r.stdout
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[4:]}
    assert rows["offload"] == ["9.450000e-03", "<-", "chosen"]
    assert rows["preempt"] == ["infeasible"]  # never at a prefill allocation
    assert set(rows) == {"evict", "offload", "preempt", "combined"}


def test_jsonl_log_defaults_to_the_last_record_and_follows_line_and_policy(tmp_path):
    log = tmp_path / "decisions.jsonl"
    records = [{"step": 10, "snapshot": SNAPSHOT, "action": "evict"},
               {"step": 11, "snapshot": HOT, "action": "offload"},
               {"step": 12, "snapshot": HOT, "policy": "evict-first", "action": "evict"}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert json.loads(explain("--json", log).stdout)["action"] == "evict"  # record 3's evict-first
    assert json.loads(explain("--json", "--line", 2, log).stdout)["action"] == "offload"
    assert json.loads(explain("--json", "--line", 3, "--policy", "cost", log).stdout)["action"] == "offload"
    first = json.loads(explain("--json", "--line", 1, log).stdout)
    assert (first["action"], first["evict_tokens"]) == ("evict", 300)
    r = explain("--line", 7, log)
    assert r.returncode == 2 and "no record on line 7" in r.stderr


def test_invalid_input_exits_2_with_the_field_on_stderr(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({**SNAPSHOT, "offload": {**SNAPSHOT["offload"], "top_k": 0}}))
    r = explain("--json", f)
    assert r.returncode == 2 and r.stdout == ""
    assert "snapshot.offload.top_k must be a positive integer" in r.stderr
    log = tmp_path / "bad.jsonl"
    log.write_text(json.dumps({"step": 1, "snapshot": SNAPSHOT}) + "\n" + json.dumps({"step": 2, "snapshot": {}}))
    r = explain(log)
    assert r.returncode == 2 and "snapshot.site is missing" in r.stderr
    r = explain(tmp_path / "absent.json")
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_restore_records_replay_to_the_same_restore_plan(tmp_path):
    from vamp_sglang.policy.restore import RestoreState, plan_restore

    state = RestoreState(idle=True, idle_s=12.5, calm_steps=0, tpot_over_slo=False, restore_after_steps=2000,
                         offloaded_groups=8,
                         expand_groups=4, pool_tokens=10240, keep_tokens=6144, used_tokens=7000,
                         evictable_tokens=5000, baseline_tokens=2048, tail_free=False, can_compact=True)
    logged = plan_restore(state)
    assert (logged.action, logged.groups, logged.evict_tokens, logged.compact) == ("restore", 4, 856, True)
    log = tmp_path / "decisions.jsonl"
    log.write_text(json.dumps({"step": 3, "site": "restore", "restore_state": state.to_json(),
                               "plan": logged.to_json()}) + "\n")
    r = explain("--json", log)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == logged.to_json()
    short = {**state.to_json(), "evictable_tokens": 100}  # cannot free the rows: no restore, nothing evicted
    log.write_text(json.dumps({"step": 4, "restore_state": short}) + "\n")
    assert json.loads(explain("--json", log).stdout)["evict_tokens"] == 0


def test_explain_shows_when_the_tpot_guard_ruled_offload_out(tmp_path):
    f = tmp_path / "guarded.json"
    f.write_text(json.dumps({**HOT, "site": "prefill", "tpot_guard_groups": 0}))
    r = explain(f)
    assert r.returncode == 0, r.stderr
    assert "TPOT guard: at most 0 of 10 headroom groups may be offloaded" in r.stdout and "ruled out" in r.stdout
    assert "plan: evict" in r.stdout  # the hot prefixes go, since offloading is not allowed
    f.write_text(json.dumps({**HOT, "site": "prefill", "tpot_guard_groups": 4}))
    assert json.loads(explain("--json", f).stdout)["groups"] == 4
