"""Percentiles, the steady-state rule (section VI-A), the outputs digest and server-counter deltas."""

import numpy as np
import pytest

from eval.server_metrics import counter_summary, parse_prometheus, total
from eval.stats import RequestRecord, outputs_digest, percentile, steady_state, summarize


def _record(session, turn, ttft, ok=True, out=(1, 2, 3), latency=None):
    return RequestRecord(session, turn, ok, 0.0, ttft if ok else None,
                         (latency if latency is not None else ttft + 0.2) if ok else None,
                         100, len(out) if ok else 0, 40, tuple(out) if ok else ())


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.3, 5.0, 1.25, 9.5, 2.0, 2.0, 7.75]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], q) is None


def test_steady_state_drops_first_turns_and_failures():
    records = [_record("a", 0, 50.0), _record("a", 1, 1.0), _record("b", 0, 60.0), _record("b", 1, 2.0),
               _record("b", 2, 0.0, ok=False)]
    assert [(r.session, r.turn) for r in steady_state(records)] == [("a", 1), ("b", 1)]
    summary = summarize(records, duration_s=2.0)
    assert summary["ttft_p99_s"] == pytest.approx(1.99)  # the 50 s and 60 s first turns are out
    assert summary["ttft_p99_all_turns_s"] > 50
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["request_throughput"] == 2.0
    assert summary["tpot_mean_s"] == pytest.approx(0.1)  # 0.2 s over 2 tokens after the first
    assert summary["client_cache_hit_rate"] == pytest.approx(0.4)


def test_digest_ignores_completion_order_but_not_tokens():
    a, b = _record("a", 0, 1.0, out=(1, 2)), _record("b", 0, 1.0, out=(3, 4))
    assert outputs_digest([a, b]) == outputs_digest([b, a])
    assert outputs_digest([a, b]) != outputs_digest([a, _record("b", 0, 1.0, out=(3, 5))])


METRICS_BEFORE = """# HELP sglang:cached_tokens_total x
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="m"} 100.0
sglang:cached_tokens_total{cache_source="host",model_name="m"} 0.0
sglang:prompt_tokens_total{is_streaming="true",model_name="m"} 400.0
sglang:num_retracted_requests_total{model_name="m"} 1.0
"""
METRICS_AFTER = """sglang:cached_tokens_total{cache_source="device",model_name="m"} 700.0
sglang:cached_tokens_total{cache_source="host",model_name="m"} 0.0
sglang:prompt_tokens_total{is_streaming="true",model_name="m"} 1000.0
sglang:prompt_tokens_total{is_streaming="false",model_name="m"} 400.0
sglang:num_retracted_requests_total{model_name="m"} 4.0
sglang:request_time_per_output_token_seconds_sum{model_name="m"} 2.0
sglang:request_time_per_output_token_seconds_count{model_name="m"} 20.0
vamp:kv_pool_tokens{tp_rank="0"} 6000.0
vamp:decisions_total{action="offload",tp_rank="0"} 3.0
vamp:decisions_total{action="evict",tp_rank="0"} 5.0
"""


def test_counter_deltas_from_prometheus_text():
    before, after = parse_prometheus(METRICS_BEFORE), parse_prometheus(METRICS_AFTER)
    assert total(after, "sglang:cached_tokens_total", cache_source="device") == 700.0
    summary = counter_summary(before, after)
    assert summary["cache_hit_rate"] == pytest.approx(600 / 1000)
    assert summary["preemptions"] == 3
    assert summary["server_tpot_mean_s"] == pytest.approx(0.1)
    assert summary["vamp_metrics_after"]["vamp:kv_pool_tokens"] == 6000.0
    assert summary["evicted_tokens"] == 0  # never touched: absent from the text, so no growth
    assert summary["vamp_metrics_delta"]["vamp:decisions_total[offload]"] == 3.0


def test_stock_server_without_series_gives_none():
    summary = counter_summary({}, {})
    assert summary["cache_hit_rate"] is None and summary["preemptions"] is None
    assert summary["vamp_metrics_after"] == {}
