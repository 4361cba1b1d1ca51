"""`python -m eval.cachesim --trace T.jsonl --pool-tokens N[,N2,...] [--policies lru,lfu,slru,vamp,opt]
[--concurrency C] [--sessions S] [--close-sessions] [--scale F] [--max-requests N] --json OUT [--plot OUT.png]`

Pool sizes are tokens, or fractions of the trace's reusable footprint with a trailing `x`
(`0.25x,0.5x,1x`); the footprint is printed. Request order and metrics: docs/cachesim.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eval.cachesim.oracle import FutureTrie
from eval.cachesim.sim import CLOSED, DEFAULT_POLICIES, sweep
from eval.cachesim.tree import prepare
from eval.cachesim.workload import build_requests
from eval.trace_format import TraceFormatError, load_trace, scale_request


def parse_pools(text: str, footprint: int) -> list[int]:
    pools = []
    for item in text.split(","):
        item = item.strip()
        value = round(float(item[:-1]) * footprint) if item.endswith("x") else int(item)
        if value < 1:
            raise ValueError(f"--pool-tokens: {item!r} is not a positive pool size")
        pools.append(value)
    return pools


def plot(result: dict, path: str, title: str, footprint: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = sorted(result["pools"], key=int)
    policies = list(result["pools"][pools[0]])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bases = [p for p in policies if CLOSED not in p]
    for policy in policies:
        base = policy.removesuffix(CLOSED)  # a closed replay: its policy's colour, dotted
        ax.plot([int(p) / footprint for p in pools], [result["pools"][p][policy]["hit_rate"] for p in pools],
                marker="o", label=policy, color=f"C{bases.index(base) % 10}",
                linestyle="--" if policy == "opt" else ":" if policy != base else "-")
    ax.set_xlabel(f"KV pool / reusable footprint ({footprint} tokens)")
    ax.set_ylabel("token hit rate (turns > 0)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def table(result: dict) -> str:
    pools = sorted(result["pools"], key=int)
    policies = list(result["pools"][pools[0]])
    lines = [f"{'pool tokens':>12} " + " ".join(f"{p:>14}" for p in policies)]
    for pool in pools:
        cells = []
        for policy in policies:
            r = result["pools"][pool][policy]
            ratio = "" if r["vs_opt"] is None else f" ({r['vs_opt']:.2f})"
            cells.append(f"{r['hit_rate']:.3f}{ratio}".rjust(14))
        lines.append(f"{pool:>12} " + " ".join(cells))
    return "\n".join(lines) + "\nhit rate over turns > 0 (ratio to opt)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.cachesim", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--pool-tokens", required=True, help="comma-separated tokens, or footprint fractions (0.5x)")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    parser.add_argument("--sessions", type=int, default=12, help="sessions active at once in the request order "
                        "(default 12, the eval runners' default; 0 = all)")
    parser.add_argument("--close-sessions", action="store_true",
                        help="also replay each policy (but opt and bound) with every trace session an SGLang "
                        "radix-native session (--enable-session-radix-cache) closed after its last turn, as a "
                        "client's /close_session does: reported as <policy>/closed")
    parser.add_argument("--scale", type=float, default=1.0, help="scale token counts (eval.trace_format)")
    parser.add_argument("--max-requests", type=int, help="the first N requests of the trace file")
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace)[: args.max_requests]
        if args.scale != 1.0:
            trace = [scale_request(r, args.scale) for r in trace]
        sessions = args.sessions or None
        requests = build_requests(trace, sessions)  # one at a time: the footprint's order
        trie = FutureTrie(requests)
        pools = parse_pools(args.pool_tokens, trie.reusable_tokens)
        if args.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1 (got {args.concurrency})")
    except (ValueError, OSError, TraceFormatError) as exc:
        parser.exit(2, f"error: {exc}\n")
    total = sum(len(r.prompt) for r in requests)
    print(f"{args.trace}: {len(requests)} requests, {total} prompt tokens, reusable footprint "
          f"{trie.reusable_tokens} tokens, unbounded-cache hit rate "
          f"{sum(trie.unbounded_hits) / total:.3f} (all turns)", file=sys.stderr)
    prepare()
    orders: dict[int, list] = {}

    def requests_for(pool: int) -> list:
        if args.concurrency == 1:
            return requests
        return orders.setdefault(pool, build_requests(trace, sessions, args.concurrency, pool))

    result = sweep(requests_for, pools, [p.strip() for p in args.policies.split(",") if p.strip()],
                   args.concurrency, args.close_sessions)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    if args.plot:
        plot(result, args.plot, f"{Path(args.trace).name}, concurrency {args.concurrency}", trie.reusable_tokens)


if __name__ == "__main__":
    main()
