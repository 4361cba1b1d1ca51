"""eval.bench_speculative without a server: the decode-step figures it reads from SGLang's log lines, the TPOT
split built on them, and its refusal of an unknown run name."""

from __future__ import annotations

import json

import pytest

from eval import bench_speculative as bs

LOG = """\
[2026-12-07 05:44:10] Prefill batch, #new-seq: 1, #new-token: 512, #cached-token: 0, token usage: 0.12, \
#running-req: 0, #queue-req: 0, #pending-token: 0, cpu graph: False, input throughput (token/s): 381.20
[2026-12-07 05:44:11] Decode batch, #running-req: 1, #token: 520, token usage: 0.13, accept len: 4.00, \
accept rate: 1.00, cpu graph: False, gen throughput (token/s): 3.30, #queue-req: 0
[2026-12-07 05:44:12] Decode batch, #running-req: 2, #token: 1800, token usage: 0.44, accept len: 3.50, \
accept rate: 0.83, cpu graph: False, gen throughput (token/s): 2.18, #queue-req: 6
[2026-12-07 05:44:13] INFO:     127.0.0.1:46478 - "POST /generate HTTP/1.1" 200 OK
[2026-12-07 05:44:14] Decode batch, #running-req: 2, #token: 1808, token usage: 0.44, accept len: 3.50, \
accept rate: 0.83, cpu graph: False, gen throughput (token/s): 56.00, #queue-req: 6
[2026-12-07 05:44:15] Prefill batch, #new-seq: 1, #new-token: 128, #cached-token: 640, token usage: 0.50, \
#running-req: 2, #queue-req: 5, #pending-token: 0, cpu graph: False, input throughput (token/s): 200.00
[2026-12-07 05:44:16] Decode batch, #running-req: 3, #token: 2600, token usage: 0.63, accept len: 3.00, \
accept rate: 0.67, cpu graph: False, gen throughput (token/s): 4.00, #queue-req: 5
[2026-12-07 05:44:17] Decode batch, #running-req: 3, #token: 2612, token usage: 0.64, accept len: 3.00, \
accept rate: 0.67, cpu graph: False, gen throughput (token/s): 60.00, #queue-req: 5
"""
PLAIN = """\
[2026-12-07 05:50:00] Decode batch, #running-req: 4, #token: 4000, token usage: 0.12, cpu graph: False, \
gen throughput (token/s): 10.00, #queue-req: 0
[2026-12-07 05:50:01] Decode batch, #running-req: 4, #token: 4004, token usage: 0.12, cpu graph: False, \
gen throughput (token/s): 40.00, #queue-req: 0
"""


def test_steps_after_a_prefill_are_told_apart_and_the_first_is_left_out():
    steps = bs.parse_steps(LOG)
    assert [(s.running, s.kv_tokens, s.accept_length, s.after_prefill) for s in steps] == [
        (2, 1800, 3.5, False), (2, 1808, 3.5, False), (3, 2600, 3.0, True), (3, 2612, 3.0, False)]
    assert steps[1].wall_s == pytest.approx(2 * 3.5 / 56.0)  # 7 tokens generated at 56 tokens/s


def test_summary_keeps_the_pure_steps_and_normalises_them():
    summary = bs.summarize_steps(bs.parse_steps(LOG))
    walls = [2 * 3.5 / 2.18, 2 * 3.5 / 56.0, 3 * 3.0 / 60.0]  # the step after the prefill is out
    assert summary["steps"] == 4 and summary["pure_steps"] == 3
    assert summary["pure_wall_s_mean"] == pytest.approx(sum(walls) / 3)
    assert summary["pure_wall_s_per_request"] == pytest.approx((walls[0] / 2 + walls[1] / 2 + walls[2] / 3) / 3)
    assert summary["pure_wall_ms_per_kv_token"] == pytest.approx(
        1e3 * (walls[0] / 1800 + walls[1] / 1808 + walls[2] / 2612) / 3)
    assert summary["pure_wall_s_by_running"] == {"2": round((walls[0] + walls[1]) / 2, 4),
                                                 "3": round(walls[2], 4)}
    assert summary["running_mean"] == pytest.approx(2.5) and summary["accept_length_mean"] == pytest.approx(3.25)
    assert summary["pure_wall_s_total"] == pytest.approx(sum(walls))
    assert summary["prefill_s_estimate"] == pytest.approx(3 * 3.0 / 4.0 - sum(walls) / 3)  # the gap, less a step


def test_summarize_only_rebuilds_from_the_raw_runs_and_keeps_the_load(tmp_path):
    for model, completed in (("qwen3", 96), ("deepseek", 95)):  # one model's runs never stand for another's
        (tmp_path / "raw" / model).mkdir(parents=True)
        log = tmp_path / f"server-{model}.log"
        log.write_text(LOG)
        result = {"server_log": str(log), "tpot_mean_s": 1.0, "completed": completed, "vamp_stats_after": None}
        (tmp_path / "raw" / model / "vamp20-spec__c8__r0.json").write_text(json.dumps(result))
    (tmp_path / "qwen3.json").write_text(json.dumps({"vamp20-spec": {"load_avg_1m_before": 4.5}}))
    (tmp_path / "notes.json").write_text(json.dumps({"note": "not a model's summary"}))  # left out of the plot
    bs.main(["qwen3", "--summarize-only", "--out-dir", str(tmp_path)])
    summary = json.loads((tmp_path / "qwen3.json").read_text())
    assert list(summary) == ["vamp20-spec"]  # the runs without a raw result are left out
    run = summary["vamp20-spec"]
    assert run["load_avg_1m_before"] == 4.5 and run["completed"] == 96 and run["kv_pool_tokens_end"] == 4096
    assert run["decode_steps"]["pure_steps"] == 3 and run["tpot_split"]["tpot_mean_s"] == 1.0
    assert (tmp_path / "tpot_split.png").stat().st_size > 0


def test_without_speculation_a_step_gives_each_request_one_token():
    (step,) = bs.parse_steps(PLAIN)
    assert step.accept_length == 1.0 and step.wall_s == pytest.approx(4 / 40.0)
    split = bs.tpot_split({"tpot_mean_s": 0.5}, bs.summarize_steps([step]))
    assert split["decode_step_s_per_token"] == pytest.approx(0.1)
    assert split["other_s_per_token"] == pytest.approx(0.4)


def test_tpot_split_divides_a_step_by_its_accepted_tokens():
    steps = bs.summarize_steps(bs.parse_steps(LOG))
    split = bs.tpot_split({"tpot_mean_s": 1.0}, steps)
    assert split["decode_step_s_per_token"] == pytest.approx(steps["pure_wall_s_mean"] / 3.25)
    assert split["other_s_per_token"] == pytest.approx(1.0 - split["decode_step_s_per_token"])
    assert bs.tpot_split({"tpot_mean_s": None}, bs.summarize_steps([]))["decode_step_s_per_token"] is None


def test_the_three_servers_share_the_speculation_and_the_reference_has_none():
    runs = bs.configs(("--speculative-algorithm", "EAGLE"))
    assert list(runs) == ["ratio0-spec", "vamp20-spec", "ratio0-large"]
    (pool0, r0), (pool1, vamp), (large, ref) = runs.values()
    assert pool0 == pool1 < large
    assert r0.flags[2:] == vamp.flags[2:] and "--speculative-eagle-topk" in vamp.flags
    assert not any(f.startswith("--speculative") for f in ref.flags)
    assert all("--decode-log-interval" in c.flags for c in (r0, vamp, ref))


def test_unknown_run_names_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bs.main(["deepseek", "--only", "ratio0-spec,vamp-20"])
    assert exit_info.value.code == 2 and "--only" in capsys.readouterr().err
