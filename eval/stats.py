"""Per-request records and the summary statistics the paper reports (section VI-A).

Steady state: TTFT percentiles leave out each session's first turn, which every session issues at
t=0 and which no prefix cache can serve. Throughput counts every completed request over the run.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw for one request (times in seconds on the client's monotonic clock)."""

    session: str
    turn: int
    ok: bool
    start_s: float
    ttft_s: float | None
    latency_s: float | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None
    output_ids: tuple[int, ...]
    output_text: str = ""  # text-mode answers (no ids); part of the digest only
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (latency - TTFT) / (n - 1)."""
        if not self.ok or self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100] (got {q!r})")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


def steady_state(records: list[RequestRecord]) -> list[RequestRecord]:
    """Completed requests except each session's first turn (section VI-A)."""
    return [r for r in records if r.ok and r.turn > 0]


def outputs_digest(records: list[RequestRecord]) -> str:
    """One hash of every request's generated ids, in (session, turn) order, so two runs of the same
    greedy workload can be compared across configurations regardless of completion order."""
    digest = hashlib.sha256()
    for record in sorted(records, key=lambda r: (r.session, r.turn)):
        digest.update(json.dumps([record.session, record.turn, list(record.output_ids),
                                  record.output_text]).encode())
    return digest.hexdigest()[:16]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, float | int | str | None]:
    """Client-side metrics of one run; server-counter metrics are added by eval.server_metrics."""
    done = [r for r in records if r.ok]
    steady_ttfts = [r.ttft_s for r in steady_state(records) if r.ttft_s is not None]
    all_ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    prompt = sum(r.prompt_tokens for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    output = sum(r.output_tokens for r in done)
    return {
        "ttft_p50_s": percentile(steady_ttfts, 50),
        "ttft_p90_s": percentile(steady_ttfts, 90),
        "ttft_p99_s": percentile(steady_ttfts, 99),
        "ttft_mean_s": _mean(steady_ttfts),
        "ttft_p99_all_turns_s": percentile(all_ttfts, 99),
        "tpot_mean_s": _mean(tpots),
        "request_throughput": len(done) / duration_s if duration_s > 0 else None,
        "output_tokens_per_s": output / duration_s if duration_s > 0 else None,
        "client_cache_hit_rate": sum(cached) / prompt if cached and prompt else None,
        "completed": len(done),
        "failed": len(records) - len(done),
        "steady_state_requests": len(steady_ttfts),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "duration_s": duration_s,
        "outputs_digest": outputs_digest(records),
    }
