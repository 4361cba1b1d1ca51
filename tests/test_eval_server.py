"""The bench client against a real CPU server started by our launcher (stock behaviour: ratio 0).

One module-scoped server with a small pool and aggressive scheduling, so retraction (a preemption)
can be provoked; every test reads what the server really did.
"""

import asyncio
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from eval.bench import BenchSpec, run_bench
from eval.multiturn import MultiTurnSpec
from eval.replay import ReplayOptions
from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model
from eval.stats import outputs_digest

pytestmark = pytest.mark.server
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"
POOL_TOKENS = 1024
SMALL = MultiTurnSpec(sessions=2, turns=3, first_turn_tokens=64, turn_growth_tokens=16, output_tokens=8,
                      block_tokens=16)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    setup = ServerSetup(str(ensure_tiny_model(MODEL)), "cpu", POOL_TOKENS,
                        extra_flags=("--schedule-conservativeness", "0.01"),
                        log_dir=str(tmp_path_factory.mktemp("logs")))
    with Server(setup, ServerConfig("stock", ("--vamp-max-offload-ratio", "0"))) as running:
        yield running


def _bench(server, spec=SMALL, api="generate", records_out=None, **options):
    bench = BenchSpec("multiturn", multiturn=spec)
    return asyncio.run(run_bench(bench, ReplayOptions(server.url, api, progress=False, **options), records_out))


def _flush(server):
    urllib.request.urlopen(urllib.request.Request(f"{server.url}/flush_cache", method="POST")).read()


def test_closed_loop_multiturn_run(server):
    _flush(server)
    result = _bench(server)
    assert (result["completed"], result["failed"], result["steady_state_requests"]) == (6, 0, 4)
    requests = {(r["session"], r["turn"]): r for r in result["requests"]}
    for session in ("s0", "s1"):
        prompts = [requests[(session, t)]["prompt_tokens"] for t in range(3)]
        assert prompts == [64, 64 + 8 + 16, 64 + 2 * (8 + 16)]  # previous prompt + real answer + new tokens
        assert all(requests[(session, t)]["output_tokens"] == 8 for t in range(3))
        assert requests[(session, 2)]["cached_tokens"] >= prompts[1]  # the previous turn came from cache
    assert 0.3 < result["cache_hit_rate"] < 1.0  # the server's own counters, not the client's
    assert all(r["ttft_s"] <= r["latency_s"] for r in result["requests"])
    assert result["ttft_p50_s"] <= result["ttft_p99_s"]
    assert result["tpot_mean_s"] > 0 and result["output_tokens_per_s"] > 0
    assert result["preemptions"] == 0
    stats = result["vamp_stats_after"]
    assert stats["kv_pool"]["tokens"] == POOL_TOKENS and stats["enabled"] is False


def test_greedy_outputs_identical_with_and_without_cache(server):
    _flush(server)
    records = []
    cold = _bench(server, records_out=records)
    warm = _bench(server, records_out=records)  # same prompts, now served from the prefix cache
    assert warm["cache_hit_rate"] > cold["cache_hit_rate"]
    assert warm["outputs_digest"] == cold["outputs_digest"]
    # each run's records, output ids included, in run order (what eval.hicache_demo compares request by request)
    assert [outputs_digest(run) for run in records] == [cold["outputs_digest"], warm["outputs_digest"]]
    assert all(len(r.output_ids) == 8 for r in records[0])
    other = _bench(server, replace(SMALL, first_turn_tokens=65))
    assert other["outputs_digest"] != cold["outputs_digest"]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_text_apis_stream(server, api):
    result = _bench(server, replace(SMALL, sessions=1), api=api)
    assert (result["completed"], result["failed"]) == (3, 0)
    rows = result["requests"]
    assert all(r["output_tokens"] == 8 and r["prompt_tokens"] > 0 for r in rows)
    assert rows[2]["prompt_tokens"] > rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]


def test_prompt_longer_than_pool_counts_as_failed(server):
    result = _bench(server, replace(SMALL, sessions=1, turns=1, first_turn_tokens=POOL_TOKENS + 200))
    assert (result["completed"], result["failed"]) == (0, 1)
    assert "exceeds the maximum allowed length" in result["requests"][0]["error"]


def _metric(server, name):
    text = urllib.request.urlopen(f"{server.url}/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_preemptions_are_read_from_server_counters(server):
    _flush(server)
    before = _metric(server, "sglang:num_retracted_requests_total")
    crowd = MultiTurnSpec(sessions=12, turns=1, first_turn_tokens=20, output_tokens=160, block_tokens=16)
    result = _bench(server, crowd)
    assert result["completed"] == 12
    assert result["preemptions"] >= 1  # 12 x 180 tokens cannot all stay in 1024 slots
    assert result["preemptions"] == _metric(server, "sglang:num_retracted_requests_total") - before
