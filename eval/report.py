"""`python -m eval.report [results] [--out results/REPORT.md]`: one Markdown summary of every target.

Per target: the Table IV rows per configuration at its highest concurrency, a TTFT p99 grid over
concurrency when there is more than one, the estimated capacity boundary per configuration, whether
greedy outputs were identical across configurations, and links to the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from eval.plots import TABLE_ROWS, cell
from eval.results import Point, aggregate

TARGETS = ("sweep-concurrency", "ablation-ratio", "ablation-policy")
CLIFF_FACTOR = 2.0  # a boundary: TTFT p99 jumps by more than this factor from one concurrency to the next


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def metric_table(points: list[Point]) -> str:
    top = max(p.concurrency for p in points)
    cols = [p for p in points if p.concurrency == top]
    rows = [[label] + [cell(p, key, scale) for p in cols] for key, label, scale in TABLE_ROWS]
    return f"At c = {top}:\n\n" + markdown_table(["Metric"] + [p.config for p in cols], rows)


def concurrency_grid(points: list[Point]) -> str:
    levels = sorted({p.concurrency for p in points})
    configs = list(dict.fromkeys(p.config for p in points))
    by = {(p.config, p.concurrency): p for p in points}
    rows = [[config] + [cell(by[(config, c)], "ttft_p99_s") if (config, c) in by else "" for c in levels]
            for config in configs]
    return "Steady-state TTFT p99 (s):\n\n" + markdown_table(["config \\ c"] + [str(c) for c in levels], rows)


def boundaries(points: list[Point]) -> str:
    lines = []
    for config in dict.fromkeys(p.config for p in points):
        line = sorted((p for p in points if p.config == config and p.mean.get("ttft_p99_s")),
                      key=lambda p: p.concurrency)
        if len(line) < 2:
            continue
        steps = [(a, b) for a, b in itertools.pairwise(line)
                 if b.mean["ttft_p99_s"] > CLIFF_FACTOR * a.mean["ttft_p99_s"]]
        if steps:
            a, b = steps[0]
            where = (f"crossed between c = {a.concurrency} and {b.concurrency} "
                     f"({a.mean['ttft_p99_s']:.3g} s -> {b.mean['ttft_p99_s']:.3g} s)")
        else:
            where = f"not crossed up to c = {line[-1].concurrency}"
        lines.append(f"- {config}: {where}")
    return (f"Capacity boundary (TTFT p99 more than {CLIFF_FACTOR:g}x the previous concurrency's):\n\n"
            + "\n".join(lines) if lines else "")


def identical_outputs(points: list[Point]) -> str:
    lines = []
    for c in sorted({p.concurrency for p in points}):
        digests = {p.config: set(p.digests) for p in points if p.concurrency == c}
        every = set().union(*digests.values())
        verdict = "identical" if len(every) == 1 else "DIFFERENT: " + ", ".join(
            f"{k}={'/'.join(sorted(v))}" for k, v in digests.items())
        lines.append(f"- c = {c}: greedy outputs {verdict}")
    return "\n".join(lines)


def section(target: str, out_dir: Path, root: Path) -> str:
    points = aggregate(out_dir)
    meta = json.loads((out_dir / "experiment.json").read_text()) if (out_dir / "experiment.json").is_file() else {}
    setup = meta.get("setup", {})
    parts = [f"## {target}",
             (f"Model `{setup.get('model_path', '?')}` on {setup.get('device', '?')} (TP {setup.get('tp_size', 1)}), "
             f"baseline pool {setup.get('max_total_tokens', '?')} tokens, n = {meta.get('runs', 1)} run(s) per point."),
             metric_table(points)]
    if len({p.concurrency for p in points}) > 1:
        parts += [concurrency_grid(points), boundaries(points)]
    parts.append(identical_outputs(points))
    parts += [f"![{png.stem}]({png.relative_to(root).as_posix()})" for png in sorted(out_dir.glob("*.png"))]
    return "\n\n".join(p for p in parts if p)


def render(root: Path) -> str:
    found = [(t, root / t) for t in TARGETS if any((root / t).glob("*__c*__r*.json"))]
    if not found:
        raise ValueError(f"no results under {root}: run make sweep-concurrency, ablation-ratio or ablation-policy")
    body = "\n\n".join(section(t, d, root) for t, d in found)
    return ("# VAMP evaluation report\n\nTTFT is client-measured and steady-state (each session's first turn "
            "excluded, paper section VI-A); cache hit rate and preemptions come from the server's counters.\n\n"
            + body + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.report", description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path("results"))
    parser.add_argument("--out", type=Path, help="default <root>/REPORT.md")
    args = parser.parse_args(argv)
    try:
        text = render(args.root)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    out = args.out or args.root / "REPORT.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
