"""`python -m eval.plots results/<target>`: the figures of one target, as PNG beside its JSON.

- ttft_p99_vs_concurrency.png: steady-state TTFT p99 against concurrency, one line per configuration
  (the paper's Figure 9); drawn when the target has more than one concurrency.
- metrics.png: TTFT p50/p99, cache hit rate, TPOT and preemptions per configuration at the highest
  concurrency (the ablations).
- table.png: the Table IV rows (mean±SD) per configuration at the highest concurrency.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from eval.results import Point, aggregate

# (metric key, label, scale to display units)
TABLE_ROWS = (
    ("request_throughput", "Request throughput (req/s)", 1.0),
    ("ttft_p90_s", "TTFT p90 (s)", 1.0),
    ("ttft_p99_s", "TTFT p99 (s)", 1.0),
    ("preemptions_per_1k_turns", "Preemptions / 1k turns", 1.0),
    ("cache_hit_rate", "Prefix-cache hit rate (%)", 100.0),
    ("tpot_mean_s", "TPOT, client (ms)", 1000.0),
    ("server_tpot_mean_s", "TPOT, server (ms)", 1000.0),
    ("kv_pool_tokens", "KV pool at end (tokens)", 1.0),
)
PANELS = (("ttft_p50_s", "TTFT p50 (s)", 1.0), ("ttft_p99_s", "TTFT p99 (s)", 1.0),
          ("cache_hit_rate", "cache hit rate (%)", 100.0), ("tpot_mean_s", "TPOT (ms)", 1000.0),
          ("preemptions", "preemptions", 1.0))


def cell(point: Point, key: str, scale: float = 1.0) -> str:
    mean, sd = point.mean.get(key), point.sd.get(key)
    if mean is None:
        return "n/a"
    return _num(mean * scale) + (f" ± {_num(sd * scale)}" if point.runs > 1 and sd is not None else "")


def _num(value: float) -> str:
    """3 significant digits, but whole numbers from 1000 up (pool sizes, not 2.05e+03)."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _top(points: list[Point]) -> list[Point]:
    top = max(p.concurrency for p in points)
    return [p for p in points if p.concurrency == top]


def plot_concurrency(points: list[Point], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for config in dict.fromkeys(p.config for p in points):
        line = [p for p in points if p.config == config and p.mean.get("ttft_p99_s") is not None]
        ax.errorbar([p.concurrency for p in line], [p.mean["ttft_p99_s"] for p in line],
                    yerr=[p.sd["ttft_p99_s"] or 0.0 for p in line], marker="o", capsize=3, label=config)
    ax.set_xlabel("concurrent sessions c")
    ax.set_ylabel("steady-state TTFT p99 (s)")
    ax.set_yscale("log")
    ax.set_title("TTFT p99 vs. concurrency (cf. paper Fig. 9)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_metrics(points: list[Point], path: Path) -> None:
    top = _top(points)
    names = [p.config for p in top]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.0 * len(PANELS), 3.6))
    for ax, (key, label, scale) in zip(axes, PANELS):
        values = [(p.mean.get(key) or 0.0) * scale for p in top]
        errors = [(p.sd.get(key) or 0.0) * scale for p in top] if max(p.runs for p in top) > 1 else None
        ax.bar(range(len(top)), values, yerr=errors, capsize=3, color=[f"C{i}" for i in range(len(top))])
        ax.set_xticks(range(len(top)), names, rotation=35, ha="right")
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"c = {top[0].concurrency}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_table(points: list[Point], path: Path) -> None:
    top = _top(points)
    rows = [[label] + [cell(p, key, scale) for p in top] for key, label, scale in TABLE_ROWS]
    fig, ax = plt.subplots(figsize=(3.0 + 1.6 * len(top), 0.32 * (len(rows) + 3)))
    ax.axis("off")
    label_width = 0.34
    table = ax.table(cellText=rows, colLabels=["Metric"] + [p.config for p in top], loc="center",
                     cellLoc="center", colWidths=[label_width] + [(1 - label_width) / len(top)] * len(top))
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1.0, 1.3)
    ax.set_title(f"c = {top[0].concurrency}, n = {top[0].runs} (cf. paper Table IV)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(out_dir: Path) -> list[Path]:
    """Every figure the target's results support; returns the files written."""
    points = aggregate(out_dir)
    if not points:
        raise ValueError(f"no result JSON under {out_dir}")
    written = []
    if len({p.concurrency for p in points}) > 1:
        plot_concurrency(points, out_dir / "ttft_p99_vs_concurrency.png")
        written.append(out_dir / "ttft_p99_vs_concurrency.png")
    plot_metrics(points, out_dir / "metrics.png")
    plot_table(points, out_dir / "table.png")
    return written + [out_dir / "metrics.png", out_dir / "table.png"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.plots", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    for path in render(args.out_dir):
        print(path)


if __name__ == "__main__":
    main()
