"""Power-of-two histograms for `/vamp/stats`: node hit counts and node ages in steps.

Hits and ages both span orders of magnitude (a system prompt may be hit thousands of times, a
one-shot prompt never; ages run from 0 to far past tau = 2,000 steps), so buckets double. Labels
are stable strings ("0", "1", "2-3", ..., ">=64") so dashboards can key on them.
"""

from __future__ import annotations

from collections.abc import Iterable


def _labels(top: int) -> list[str]:
    labels, low = ["0", "1"], 2
    while low < top:
        labels.append(f"{low}-{min(2 * low, top) - 1}")
        low *= 2
    labels.append(f">={top}")
    return labels


def _bucket(value: int, top: int) -> int:
    if value >= top:
        return -1
    return 0 if value <= 0 else value.bit_length()


def pow2_histogram(values: Iterable[int], top: int) -> dict[str, int]:
    """Counts of `values` in buckets 0, 1, 2-3, 4-7, ..., >=top (top a power of two >= 2)."""
    if top < 2 or top & (top - 1):
        raise ValueError(f"pow2_histogram needs a power of two >= 2 as top (got {top!r})")
    labels = _labels(top)
    counts = [0] * len(labels)
    for value in values:
        if value < 0:
            raise ValueError(f"pow2_histogram counts values >= 0 (got {value!r})")
        counts[_bucket(value, top)] += 1
    return dict(zip(labels, counts))
