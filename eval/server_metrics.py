"""Server-side counters: `/metrics` (Prometheus text, `sglang:*` and `vamp:*`) and `/vamp/stats` (JSON).

The bench reads both before and after a run; counters are compared as deltas, so one server can
serve several runs. The paper takes cache hit rate, preemptions and TPOT from server counters
(section VI-A); a stock SGLang server has no `/vamp/stats` and that is reported as null, not an error.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import aiohttp

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

CACHED_TOKENS = "sglang:cached_tokens_total"
PROMPT_TOKENS = "sglang:prompt_tokens_total"
RETRACTIONS = "sglang:num_retracted_requests_total"
TPOT_SUM = "sglang:request_time_per_output_token_seconds_sum"
TPOT_COUNT = "sglang:request_time_per_output_token_seconds_count"
GENERATION_TOKENS = "sglang:generation_tokens_total"
EVICTED_TOKENS = "sglang:evicted_tokens_total"

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_prometheus(text: str) -> Samples:
    """Every sample by series name, with its labels; comments and malformed lines are skipped."""
    samples: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if line.startswith("#") or not match:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), number))
    return samples


def total(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of a series over all label sets matching `labels`; None when the server has no such series."""
    if name not in samples:
        return None
    return sum(v for found, v in samples[name] if all(found.get(k) == want for k, want in labels.items()))


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float | None:
    """A counter's growth; a series never touched is absent from /metrics and counts as 0, unless the
    server exposes no metrics at all (started without --enable-metrics: None)."""
    if not after:
        return None
    return (total(after, name, **labels) or 0.0) - (total(before, name, **labels) or 0.0)


def vamp_series(samples: Samples) -> dict[str, float]:
    """Every `vamp:*` series summed over labels, with decisions split by action."""
    out: dict[str, float] = {}
    for name, rows in samples.items():
        if not name.startswith("vamp:") or name.endswith("_created"):
            continue
        if name.startswith("vamp:decisions"):
            for labels, value in rows:
                key = f"{name}[{labels.get('action', '')}]"
                out[key] = out.get(key, 0.0) + value
        else:
            out[name] = sum(v for _, v in rows)
    return out


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def counter_summary(before: Samples, after: Samples) -> dict[str, Any]:
    """The run's server-counter metrics: cache hit rate, preemptions, server TPOT, VAMP series."""
    vamp_before, vamp_after = vamp_series(before), vamp_series(after)
    retracted = delta(before, after, RETRACTIONS)
    return {
        "cache_hit_rate": _ratio(delta(before, after, CACHED_TOKENS), delta(before, after, PROMPT_TOKENS)),
        "preemptions": None if retracted is None else int(retracted),
        "server_tpot_mean_s": _ratio(delta(before, after, TPOT_SUM), delta(before, after, TPOT_COUNT)),
        "evicted_tokens": delta(before, after, EVICTED_TOKENS),
        "vamp_metrics_after": vamp_after,
        "vamp_metrics_delta": {k: v - vamp_before.get(k, 0.0) for k, v in vamp_after.items()},
    }


async def fetch_metrics(http: aiohttp.ClientSession, url: str) -> Samples:
    """`/metrics`, or an empty sample set (with no series) when the server runs without --enable-metrics."""
    async with http.get(f"{url}/metrics") as response:
        if response.status == 404:
            return {}
        response.raise_for_status()
        return parse_prometheus(await response.text())


async def fetch_vamp_stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    """`/vamp/stats`, or None on a stock SGLang server."""
    async with http.get(f"{url}/vamp/stats") as response:
        if response.status == 404:
            return None
        response.raise_for_status()
        data = json.loads(await response.text(), parse_constant=lambda c: math.nan)
        return data if isinstance(data, dict) else {"value": data}
