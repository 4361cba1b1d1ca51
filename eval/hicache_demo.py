"""`python -m eval.hicache_demo` (issue 22): the multi-turn run of `make demo` past the prefix-cache cliff against
four servers: stock (VAMP off), HiCache alone, VAMP alone and VAMP + HiCache.

All four start with the same device pool (`--max-total-tokens`); both HiCache runs get the same host pool
(`--hicache-ratio` times that start-up pool; VAMP grows the device pool at run time, never the host pool) with the
`direct` io backend. The table adds to the demo's rows the device and host hit tokens (`/vamp/stats` hicache
section), the tokens that were prefilled again (prompt tokens the cache did not cover) and the decision counts.
On CPU a host load is a memcpy in the same DRAM, nearly free: docs/hicache.md says which figures carry over.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eval import demo
from eval.runners import BASELINE, TINY_MODEL, vamp
from eval.servers import ServerConfig, ServerSetup, ensure_tiny_model


def _hicache(result: dict, key: str) -> str:
    tier = ((result.get("vamp_stats_after") or {}).get("hicache") or {})
    before = ((result.get("vamp_stats_before") or {}).get("hicache") or {})
    return "n/a" if key not in tier else str(tier[key] - before.get(key, 0))


def _reprefilled(result: dict) -> str:
    rate, prompt = result.get("client_cache_hit_rate"), result.get("prompt_tokens")
    return "n/a" if rate is None or not prompt else str(round(prompt * (1 - rate)))


ROWS = demo.ROWS[:4] + (
    ("device hit tokens", lambda r: _hicache(r, "device_hit_tokens")),
    ("host hit tokens", lambda r: _hicache(r, "host_hit_tokens")),
    ("re-prefilled tokens", _reprefilled),
) + demo.ROWS[4:]


def configs(ratio: float, hicache_ratio: float) -> list[ServerConfig]:
    hicache = ("--enable-hierarchical-cache", "--hicache-ratio", f"{hicache_ratio:g}", "--hicache-io-backend", "direct")
    with_vamp = vamp(ratio)
    return [ServerConfig("stock", BASELINE.flags), ServerConfig("hicache", BASELINE.flags + hicache), with_vamp,
            ServerConfig(f"{with_vamp.name}+hicache", with_vamp.flags + hicache)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.hicache_demo", description=__doc__.splitlines()[0])
    demo.add_demo_args(parser, "results/hicache")
    parser.set_defaults(ratio=0.2)
    parser.add_argument("--hicache-ratio", type=float, default=4.0, help="host pool = this x the start-up pool")
    args = parser.parse_args(argv)
    if args.model == TINY_MODEL:
        ensure_tiny_model(args.model)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = ServerSetup(args.model, "cpu", args.max_total_tokens, log_dir=str(out_dir / "logs"),
                        extra_flags=("--enable-cache-report",))
    runs = configs(args.ratio, args.hicache_ratio)
    results = demo.serve_each(setup, demo.demo_spec(args), runs, out_dir)
    print(f"\n{args.sessions} sessions x {args.turns} turns, start-up device pool {args.max_total_tokens} tokens, "
          f"host pool {args.hicache_ratio:g}x\n")
    print(demo.table([c.name for c in runs], results, ROWS))


if __name__ == "__main__":
    main()
