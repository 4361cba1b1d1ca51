"""`python -m eval.demo` (make demo): stock SGLang (ratio 0) against VAMP on one short multi-turn run.

The pool is sized so the sessions' reusable prefixes do not fit the baseline: the baseline evicts and
recomputes them, VAMP grows the pool from expert memory and keeps them. The table shows the
difference, and the outputs digest shows greedy answers stayed identical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from eval.bench import BenchSpec, run_bench
from eval.multiturn import MultiTurnSpec
from eval.replay import ReplayOptions
from eval.runners import BASELINE, TINY_MODEL, vamp
from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model


def _s(value: float | None, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:.3g}{unit}"


def _pool(result: dict) -> str:
    before, after = result.get("vamp_stats_before") or {}, result.get("vamp_stats_after") or {}
    start = (before.get("kv_pool") or {}).get("tokens")
    end = (after.get("kv_pool") or {}).get("tokens")
    return "n/a" if start is None else f"{start} -> {end}"


def _decisions(result: dict) -> str:
    after = (result.get("vamp_stats_after") or {}).get("decisions") or {}
    before = (result.get("vamp_stats_before") or {}).get("decisions") or {}
    counts = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


ROWS = (
    ("TTFT p50 (steady state)", lambda r: _s(r["ttft_p50_s"], 1, " s")),
    ("TTFT p99 (steady state)", lambda r: _s(r["ttft_p99_s"], 1, " s")),
    ("TPOT mean", lambda r: _s(r["tpot_mean_s"], 1000, " ms")),
    ("prefix-cache hit rate", lambda r: _s(r["cache_hit_rate"], 100, " %")),
    ("preemptions", lambda r: str(r["preemptions"])),
    ("KV pool (tokens)", _pool),
    ("VAMP decisions", _decisions),
    ("requests ok / failed", lambda r: f"{r['completed']} / {r['failed']}"),
    ("run time", lambda r: _s(r["duration_s"], 1, " s")),
)


def table(names: list[str], results: list[dict], rows: tuple = ROWS) -> str:
    width = max(len(label) for label, _ in rows) + 2
    cols = [[fmt(r) for r in results] for _, fmt in rows]
    col_w = [max(len(n), *(len(c[i]) for c in cols)) + 2 for i, n in enumerate(names)]
    lines = ["".ljust(width) + "".join(n.rjust(w) for n, w in zip(names, col_w))]
    lines += [label.ljust(width) + "".join(v.rjust(w) for v, w in zip(values, col_w))
              for (label, _), values in zip(rows, cols)]
    same = len({r["outputs_digest"] for r in results}) == 1
    lines.append(f"greedy outputs identical: {'yes' if same else 'NO'} "
                 f"({', '.join(r['outputs_digest'] for r in results)})")
    return "\n".join(lines)


def add_demo_args(parser: argparse.ArgumentParser, out_dir: str) -> None:
    """The demo's model, pool and workload flags (also used by eval.demo_multinode)."""
    parser.add_argument("--model", default=TINY_MODEL)
    parser.add_argument("--max-total-tokens", type=int, default=2048, help="the baseline KV pool")
    parser.add_argument("--ratio", type=float, default=0.15, help="VAMP's max offload ratio (paper: VAMP-15)")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--out-dir", default=out_dir)


def demo_spec(args: argparse.Namespace) -> BenchSpec:
    """The short multi-turn run whose reusable prefixes overflow the baseline pool."""
    return BenchSpec("multiturn", multiturn=MultiTurnSpec(
        args.sessions, args.turns, first_turn_tokens=256, turn_growth_tokens=64, output_tokens=16,
        block_tokens=32).validate())


def serve_each(setup: ServerSetup, spec: BenchSpec, configs: list[ServerConfig], out_dir: Path,
               records_out: list | None = None) -> list[dict]:
    """The same run against one server per configuration, in turn; each result is also saved as JSON.
    `records_out`: each run's request records (with output ids) are appended to it, in run order."""
    results = []
    for config in configs:
        print(f"--- {config.name}: starting server ({' '.join(config.flags)})", flush=True)
        with Server(setup, config) as server:
            result = asyncio.run(run_bench(spec, ReplayOptions(server.url), records_out))
        (out_dir / f"{config.name}.json").write_text(json.dumps(result, indent=1))
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.demo", description=__doc__.splitlines()[0])
    add_demo_args(parser, "results/demo")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.model == TINY_MODEL:
        ensure_tiny_model(args.model)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = ServerSetup(args.model, args.device, args.max_total_tokens, log_dir=str(out_dir / "logs"))
    configs = [BASELINE, vamp(args.ratio)]
    results = serve_each(setup, demo_spec(args), configs, out_dir)
    print(f"\n{args.sessions} sessions x {args.turns} turns, baseline pool {args.max_total_tokens} tokens\n")
    print(table([c.name for c in configs], results))


if __name__ == "__main__":
    main()
