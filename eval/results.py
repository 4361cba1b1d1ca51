"""Read a target's result JSONs back and aggregate repeats as mean and SD (the paper reports mean±SD)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_mean_s", "server_tpot_mean_s", "request_throughput",
           "output_tokens_per_s", "cache_hit_rate", "preemptions", "preemptions_per_1k_turns", "completed",
           "failed", "kv_pool_tokens", "offload_ratio")


@dataclass(frozen=True)
class Point:
    """One (configuration, concurrency) cell over its repeats."""

    config: str
    concurrency: int
    runs: int
    mean: dict[str, float | None]
    sd: dict[str, float | None]
    digests: tuple[str, ...]


def _vamp_value(result: dict, section: str, key: str) -> float | None:
    stats = result.get("vamp_stats_after") or {}
    value = (stats.get(section) or {}).get(key) if isinstance(stats.get(section), dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def derived(result: dict) -> dict[str, float | None]:
    """The metrics of one run, with per-1k-turn preemptions and the final VAMP pool state added."""
    values = {k: result.get(k) for k in METRICS}
    turns = result.get("completed") or 0
    preempt = result.get("preemptions")
    values["preemptions_per_1k_turns"] = None if preempt is None or not turns else 1000.0 * preempt / turns
    values["kv_pool_tokens"] = _vamp_value(result, "kv_pool", "tokens")
    values["offload_ratio"] = _vamp_value(result, "experts", "offload_ratio")
    return values


def load(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*__c*__r*.json"))]


def config_order(out_dir: Path, results: list[dict]) -> list[str]:
    """The experiment's configuration order (baseline first), then any others found."""
    meta = Path(out_dir) / "experiment.json"
    names = [c["name"] for c in json.loads(meta.read_text())["experiment"]["configs"]] if meta.is_file() else []
    return names + sorted({r["config"]["name"] for r in results} - set(names))


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(out_dir: Path) -> list[Point]:
    results = load(out_dir)
    order = config_order(out_dir, results)
    cells: dict[tuple[str, int], list[dict]] = {}
    for result in results:
        cells.setdefault((result["config"]["name"], result["concurrency"]), []).append(result)
    points = []
    for (config, concurrency), runs in sorted(cells.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        rows = [derived(r) for r in runs]
        mean, sd = {}, {}
        for key in rows[0]:
            values = [r[key] for r in rows if isinstance(r[key], (int, float)) and math.isfinite(r[key])]
            mean[key], sd[key] = _mean_sd(values)
        points.append(Point(config, concurrency, len(runs), mean, sd, tuple(r["outputs_digest"] for r in runs)))
    return points
