#!/usr/bin/env python
"""TPOT of whole-region vs auto staging on a real server (issue 12 acceptance, server level).

Same greedy requests against: ratio 0 (stock SGLang path), and VAMP-25 with all of it offloaded from the
start (`--vamp-initial-offload-ratio 0.25`) under `--vamp-staging whole` and `auto` (and `routed` with
--with-routed). The pool (`--max-total-tokens`) is large enough that nothing is evicted, so the only
difference is staging. Per configuration one server (serialised through eval/servers.py's lock), then
1, 4 and 16 concurrent sessions, each sending `--requests` requests in turn (distinct prompts, exactly
`--output-tokens` tokens). TPOT per request = (latency - TTFT) / (tokens - 1), at the client. The
configurations run in `--rounds` interleaved rounds (A B C A B C ...: the box is shared, so a load spike
hits one round, not one configuration), each round with a fresh server; a configuration's TPOT at a
concurrency is the median over rounds of that round's mean. Reported: TPOT per configuration and
concurrency, each VAMP mode's overhead over ratio 0, the acceptance ratio (auto overhead / whole
overhead), and whether every output equals ratio 0's.

    OMP_NUM_THREADS=1 .venv/bin/python -m eval.bench_staging_server --json results/bench_staging_server.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from pathlib import Path

import aiohttp

from eval.client import generate
from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json

VAMP_25 = ("--vamp-max-offload-ratio", "0.25", "--vamp-initial-offload-ratio", "0.25")
CONFIGS = {"ratio-0": ServerConfig("ratio-0", ("--vamp-max-offload-ratio", "0")),
           "whole": ServerConfig("vamp25-whole", (*VAMP_25, "--vamp-staging", "whole")),
           "auto": ServerConfig("vamp25-auto", (*VAMP_25, "--vamp-staging", "auto")),
           "routed": ServerConfig("vamp25-routed", (*VAMP_25, "--vamp-staging", "routed"))}


def prompts(sessions: int, requests: int, tokens: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """[session][request] -> token ids; distinct per request so no prefix is shared by accident."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(requests)] for _ in range(sessions)]


async def run_sessions(url: str, work: list[list[list[int]]], output_tokens: int) -> list[list[dict]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def session(requests: list[list[int]]) -> list[dict]:
            out = []
            for ids in requests:
                answer = await generate(http, url, ids, output_tokens)
                if not answer.ok:
                    raise RuntimeError(f"request failed: {answer.error}")
                tpot = (answer.latency_s - answer.ttft_s) / max(answer.output_tokens - 1, 1)
                out.append({"tpot_s": tpot, "ttft_s": answer.ttft_s, "output_ids": answer.output_ids})
            return out
        return list(await asyncio.gather(*(session(r) for r in work)))


def run_config(setup: ServerSetup, config: ServerConfig, concurrencies: list[int], args) -> dict:
    """One fresh server of `config`: a warm-up request, then each concurrency in turn."""
    result: dict = {"config": config.name, "concurrency": {}}
    with Server(setup, config) as server:
        asyncio.run(run_sessions(server.url, prompts(1, 2, args.prompt_tokens, args.vocab, 999), args.output_tokens))
        for c in concurrencies:
            work = prompts(c, args.requests, args.prompt_tokens, args.vocab, seed=c)
            answers = asyncio.run(run_sessions(server.url, work, args.output_tokens))
            tpots = [a["tpot_s"] for session in answers for a in session]
            result["concurrency"][str(c)] = {
                "tpot_ms_mean": statistics.mean(tpots) * 1e3, "tpot_ms_median": statistics.median(tpots) * 1e3,
                "ttft_ms_median": statistics.median(a["ttft_s"] for s in answers for a in s) * 1e3,
                "outputs": [[a["output_ids"] for a in session] for session in answers]}
            print(f"[{config.name}] c={c}: TPOT mean {result['concurrency'][str(c)]['tpot_ms_mean']:.2f} ms",
                  flush=True)
        stats = get_json(f"{server.url}/vamp/stats")
        result["staging"] = stats.get("staging")
        result["kv_pool"] = stats.get("kv_pool")
        result["evictions"] = stats.get("decisions", {})
    return result


def summarise(results: dict[str, list[dict]], concurrencies: list[int]) -> dict:
    """Per concurrency: each mode's median-over-rounds TPOT, overheads over ratio 0, identical outputs."""
    base = results["ratio-0"][0]["concurrency"]
    summary = {}
    for c in map(str, concurrencies):
        row = {mode: statistics.median(r["concurrency"][c]["tpot_ms_mean"] for r in rounds)
               for mode, rounds in results.items()}
        for mode, rounds in results.items():
            if mode != "ratio-0":
                row[f"{mode}_overhead_ms"] = row[mode] - row["ratio-0"]
                row[f"{mode}_identical"] = all(r["concurrency"][c]["outputs"] == base[c]["outputs"] for r in rounds)
        whole = row["whole_overhead_ms"]
        row["auto_over_whole_overhead"] = row["auto_overhead_ms"] / whole if whole > 0 else None
        summary[c] = row
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3-moe")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=3, help="requests per session, sent in turn")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool cap: nothing is evicted")
    parser.add_argument("--with-routed", action="store_true", help="also run --vamp-staging routed")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every configuration")
    args = parser.parse_args()
    if args.device == "cpu":
        ensure_tiny_model(args.model)
    setup = ServerSetup(args.model, args.device, max_total_tokens=args.max_total_tokens)
    modes = ["ratio-0", "whole", "auto"] + (["routed"] if args.with_routed else [])
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            results[mode].append(run_config(setup, CONFIGS[mode], args.concurrency, args))
    summary = summarise(results, args.concurrency)
    print(f"{'sessions':>8}  " + "  ".join(f"{m + ' TPOT ms':>16}" for m in modes)
          + "  whole +ms  auto +ms  auto/whole  identical")
    for c, row in summary.items():
        same = all(row[f"{m}_identical"] for m in modes if m != "ratio-0")
        ratio = row["auto_over_whole_overhead"]
        print(f"{c:>8}  " + "  ".join(f"{row[m]:16.2f}" for m in modes)
              + f"  {row['whole_overhead_ms']:9.2f}  {row['auto_overhead_ms']:8.2f}  "
              + f"{'n/a' if ratio is None else f'{ratio:10.3f}':>10}  {'yes' if same else 'NO'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
