"""`python -m eval.hicache_demo` (issue 22): the multi-turn run of `make demo` past the prefix-cache cliff against
four servers: stock (VAMP off), HiCache alone, VAMP alone and VAMP + HiCache, and a fifth, stock with a device
pool large enough that nothing is evicted (`unbounded`), whose greedy outputs are the reference.

The four start with the same device pool (`--max-total-tokens`); both HiCache runs get the same host pool
(`--hicache-ratio` times that start-up pool; VAMP grows the device pool at run time, never the host pool) with the
`direct` io backend. The table adds to the demo's rows the device and host hit tokens (`/vamp/stats` hicache
section), the tokens that were prefilled again (prompt tokens the cache did not cover), the requests that hit
their whole previous context (`full-hit requests`: the cached tokens reach the previous turn's prompt and answer,
less the answer's last token, which SGLang does not cache) and how many requests answered exactly what the
unbounded pool answered. Each request that differs is listed, with whether it or an earlier turn of its session
was re-prefilled (its prompt then differs too). On CPU a host load is a memcpy in the same DRAM, nearly free:
docs/hicache.md says which figures carry over.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval import demo
from eval.runners import BASELINE, TINY_MODEL, vamp
from eval.servers import ServerConfig, ServerSetup, ensure_tiny_model
from eval.stats import RequestRecord

UNBOUNDED = "unbounded"


def _hicache(result: dict, key: str) -> str:
    tier = ((result.get("vamp_stats_after") or {}).get("hicache") or {})
    before = ((result.get("vamp_stats_before") or {}).get("hicache") or {})
    return "n/a" if key not in tier else str(tier[key] - before.get(key, 0))


def _reprefilled(result: dict) -> str:
    rate, prompt = result.get("client_cache_hit_rate"), result.get("prompt_tokens")
    return "n/a" if rate is None or not prompt else str(round(prompt * (1 - rate)))


def missed_tokens(records: list[RequestRecord]) -> dict[tuple[str, int], int]:
    """Per later turn: the tokens of its previous context (previous prompt and answer, less the answer's last
    token) that the cache did not cover, i.e. prefilled again; 0 = a full hit."""
    by_key = {(r.session, r.turn): r for r in records if r.ok}
    missed = {}
    for (session, turn), record in by_key.items():
        previous = by_key.get((session, turn - 1))
        if turn > 0 and previous is not None and record.cached_tokens is not None:
            reusable = previous.prompt_tokens + previous.output_tokens - 1
            missed[(session, turn)] = max(0, reusable - record.cached_tokens)
    return missed


def compare(records: list[RequestRecord], reference: list[RequestRecord] | None) -> dict:
    """Request by request against the reference run (when there is one): which answers differ, and for each
    whether it or an earlier turn of its session was re-prefilled here."""
    ref = {(r.session, r.turn): r.output_ids for r in reference or () if r.ok}
    missed = missed_tokens(records)
    differ = []
    for r in sorted(records, key=lambda r: (r.session, r.turn)):
        if reference is not None and r.ok and ref.get((r.session, r.turn)) != r.output_ids:
            earlier = [t for t in range(1, r.turn + 1) if missed.get((r.session, t), 0) > 0]
            differ.append({"session": r.session, "turn": r.turn, "reprefilled_tokens": missed.get((r.session, r.turn), 0),
                           "reprefilled_turns_so_far": earlier})
    return {"reference": reference is not None, "requests": sum(r.ok for r in records), "equal": sum(r.ok for r in records) - len(differ),
            "full_hits": sum(v == 0 for v in missed.values()), "later_turns": len(missed), "differ": differ}


ROWS = demo.ROWS[:4] + (
    ("device hit tokens", lambda r: _hicache(r, "device_hit_tokens")),
    ("host hit tokens", lambda r: _hicache(r, "host_hit_tokens")),
    ("re-prefilled tokens", _reprefilled),
    ("full-hit requests", lambda r: f"{r['vs_unbounded']['full_hits']} / {r['vs_unbounded']['later_turns']}"),
    ("outputs = unbounded", lambda r: f"{r['vs_unbounded']['equal']} / {r['vs_unbounded']['requests']}"
     if r["vs_unbounded"]["reference"] else "n/a"),
) + demo.ROWS[4:]


def configs(ratio: float, hicache_ratio: float, unbounded_tokens: int) -> list[ServerConfig]:
    hicache = ("--enable-hierarchical-cache", "--hicache-ratio", f"{hicache_ratio:g}", "--hicache-io-backend", "direct")
    with_vamp = vamp(ratio)
    return [ServerConfig("stock", BASELINE.flags), ServerConfig("hicache", BASELINE.flags + hicache), with_vamp,
            ServerConfig(f"{with_vamp.name}+hicache", with_vamp.flags + hicache),
            ServerConfig(UNBOUNDED, BASELINE.flags + ("--max-total-tokens", str(unbounded_tokens)))]


def _differences(names: list[str], results: list[dict]) -> list[str]:
    if not results or not results[-1]["vs_unbounded"]["reference"]:
        return [f"  no {UNBOUNDED} run: outputs not compared request by request"]
    lines = []
    for name, result in zip(names, results):
        for d in result["vs_unbounded"]["differ"]:
            lines.append(f"  {name}: {d['session']} turn {d['turn']} differs from unbounded (re-prefilled "
                         f"{d['reprefilled_tokens']} tokens; re-prefilled turns of its session so far: "
                         f"{d['reprefilled_turns_so_far'] or 'none'})")
    return lines or ["  every request of every run answered what the unbounded pool answered"]


def staging_by_load(result: dict) -> dict | None:
    """The run's staging wait in decode forwards and in extend forwards with and without a HiCache host load for
    their batch (`/vamp/stats` hicache.staging_by_load, after minus before); None where the server has none (VAMP
    or HiCache off)."""
    after = ((result.get("vamp_stats_after") or {}).get("hicache") or {}).get("staging_by_load")
    before = ((result.get("vamp_stats_before") or {}).get("hicache") or {}).get("staging_by_load") or {}
    if after is None:
        return None
    return {kind: {k: v - before.get(kind, {}).get(k, 0) for k, v in row.items()} for kind, row in after.items()}


def _staging_lines(names: list[str], results: list[dict]) -> list[str]:
    lines = []
    for name, result in zip(names, results):
        for kind, row in (staging_by_load(result) or {}).items():
            size = "tokens" if "tokens" in row else "requests"
            per_step = (f"{row['staging_wait_s'] / row['steps'] * 1e3:.3g} ms staging wait and "
                        f"{row[size] / row['steps']:.3g} {size} a forward") if row["steps"] else "-"
            lines.append(f"  {name} {kind.replace('_', ' ')}: {row['steps']} forwards, {per_step}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.hicache_demo", description=__doc__.splitlines()[0])
    demo.add_demo_args(parser, "results/hicache")
    parser.set_defaults(ratio=0.2)
    parser.add_argument("--hicache-ratio", type=float, default=4.0, help="host pool = this x the start-up pool")
    parser.add_argument("--unbounded-tokens", type=int, default=65536,
                        help="the reference run's device pool: large enough that nothing is evicted")
    parser.add_argument("--only", help="run only these configurations, comma-separated (e.g. vamp-20+hicache)")
    args = parser.parse_args(argv)
    if args.model == TINY_MODEL:
        ensure_tiny_model(args.model)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = ServerSetup(args.model, "cpu", args.max_total_tokens, log_dir=str(out_dir / "logs"),
                        extra_flags=("--enable-cache-report",))
    runs = configs(args.ratio, args.hicache_ratio, args.unbounded_tokens)
    if args.only:
        wanted = args.only.split(",")
        if unknown := set(wanted) - {c.name for c in runs}:
            parser.error(f"--only: no configuration {', '.join(sorted(unknown))} (have {', '.join(c.name for c in runs)})")
        runs = [c for c in runs if c.name in wanted]
    records: list[list[RequestRecord]] = []
    results = demo.serve_each(setup, demo.demo_spec(args), runs, out_dir, records)
    for config, result, recs in zip(runs, results, records, strict=True):
        result["vs_unbounded"] = compare(recs, records[-1] if runs[-1].name == UNBOUNDED else None)
        (out_dir / f"{config.name}.vs-unbounded.json").write_text(json.dumps(result["vs_unbounded"], indent=1))
    names = [c.name for c in runs]
    print(f"\n{args.sessions} sessions x {args.turns} turns, start-up device pool {args.max_total_tokens} tokens "
          f"({UNBOUNDED}: {args.unbounded_tokens}), host pool {args.hicache_ratio:g}x\n")
    print(demo.table(names, results, ROWS))
    print("\n".join(_differences(names, results)))
    print("\n".join(_staging_lines(names, results)))


if __name__ == "__main__":
    main()
