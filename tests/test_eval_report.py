"""Aggregation of repeats, the capacity-boundary estimate, the identical-outputs check, figures."""

import json

import pytest

from eval import plots, report
from eval.results import aggregate


def _result(config, c, run, p99, digest="d1", preemptions=0):
    return {"config": {"name": config, "flags": []}, "concurrency": c, "run": run, "ttft_p50_s": p99 / 2,
            "ttft_p90_s": p99 * 0.9, "ttft_p99_s": p99, "tpot_mean_s": 0.03, "server_tpot_mean_s": 0.03,
            "request_throughput": 2.0, "output_tokens_per_s": 30.0, "cache_hit_rate": 0.5,
            "preemptions": preemptions, "completed": 100, "failed": 0, "outputs_digest": digest,
            "vamp_stats_after": {"kv_pool": {"tokens": 4096}, "experts": {"offload_ratio": 0.1}}}


@pytest.fixture
def sweep(tmp_path):
    out = tmp_path / "sweep-concurrency"
    out.mkdir()
    rows = [("baseline", 2, 0, 1.0), ("baseline", 2, 1, 1.2), ("baseline", 8, 0, 9.0), ("baseline", 8, 1, 11.0),
            ("vamp-15", 2, 0, 1.0), ("vamp-15", 2, 1, 1.0), ("vamp-15", 8, 0, 1.5), ("vamp-15", 8, 1, 1.5)]
    for name, c, run, p99 in rows:
        (out / f"{name}__c{c}__r{run}.json").write_text(json.dumps(_result(name, c, run, p99, preemptions=run)))
    meta = {"experiment": {"configs": [{"name": "baseline"}, {"name": "vamp-15"}]},
            "setup": {"model_path": "m", "device": "cpu", "max_total_tokens": 2048}, "runs": 2}
    (out / "experiment.json").write_text(json.dumps(meta))
    return out


def test_repeats_become_mean_and_sd(sweep):
    points = {(p.config, p.concurrency): p for p in aggregate(sweep)}
    base8 = points[("baseline", 8)]
    assert base8.runs == 2 and base8.mean["ttft_p99_s"] == pytest.approx(10.0)
    assert base8.sd["ttft_p99_s"] == pytest.approx(2 ** 0.5)
    assert base8.mean["preemptions_per_1k_turns"] == pytest.approx(5.0)
    assert base8.mean["kv_pool_tokens"] == 4096
    assert [p.config for p in aggregate(sweep)][:2] == ["baseline", "baseline"]  # experiment order


def test_report_finds_the_boundary_and_checks_outputs(sweep):
    text = report.render(sweep.parent)
    assert "- baseline: crossed between c = 2 and 8 (1.1 s -> 10 s)" in text
    assert "- vamp-15: not crossed up to c = 8" in text
    assert "c = 8: greedy outputs identical" in text
    assert "| TTFT p99 (s) | 10 ± 1.41 | 1.5 ± 0 |" in text
    bad = json.loads((sweep / "vamp-15__c8__r0.json").read_text()) | {"outputs_digest": "d2"}
    (sweep / "vamp-15__c8__r0.json").write_text(json.dumps(bad))
    assert "c = 8: greedy outputs DIFFERENT" in report.render(sweep.parent)


def test_figures_are_written(sweep):
    written = plots.render(sweep)
    assert {p.name for p in written} == {"ttft_p99_vs_concurrency.png", "metrics.png", "table.png"}
    assert all(p.stat().st_size > 5000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_empty_results_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no results under"):
        report.render(tmp_path)
