"""`python -m eval.bench_tree [--requests N] [--pool-tokens T] [--seed S]`: radix tree core throughput.

Replays one generated operation trace through SGLang's real `UnifiedRadixCache` over each tree core:
SGLang's Rust core (the default), SGLang's Python core (both with LRU), ours (`VampTreeCore`
with its p_eff order; and with LRU, to separate the cost of the statistics from the cost of the
order), and the same p_eff order kept beside SGLang's Rust core (`VampRustTreeCore`, radix_rust.py). Each request does what the scheduler does: match its prefix, lock it, count the admission,
allocate the extension (evicting the shortfall), insert, unlock. A final phase evicts the whole
tree in fixed chunks. Prints per-operation ops/s and the ratio to the Rust core; a script, not a
test, because timings depend on the machine.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from eval.cachesim.tree import TreeReplay, build, prepare

CORES = {  # label: simulator policy (eval.cachesim.tree.cache_spec: tree core, eviction policy, cache class)
    "rust (sglang default)": "lru",
    "python (sglang)": "python:lru",
    "vamp stats + lru": "vamp+lru",
    "vamp stats + p_eff order": "vamp",
    "vamp p_eff on rust core": "vamp-rust",
}


def make_trace(requests: int, sessions: int, seed: int) -> list[list[int]]:
    """Multi-turn sessions (each turn extends its history) interleaved with one-shot prompts."""
    rng = random.Random(seed)
    histories = [[rng.randrange(32000) for _ in range(rng.randint(32, 256))] for _ in range(sessions)]
    trace = []
    for _ in range(requests):
        if rng.random() < 0.5:
            history = histories[rng.randrange(sessions)]
            history.extend(rng.randrange(32000) for _ in range(rng.randint(16, 96)))
            if len(history) > 2048:
                del history[256:]
            trace.append(list(history))
        else:
            trace.append([rng.randrange(32000) for _ in range(rng.randint(64, 512))])
    return trace


@dataclass
class Timer:
    seconds: dict[str, float]
    calls: dict[str, int]

    def run(self, op: str, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.seconds[op] += time.perf_counter() - start
        self.calls[op] += 1
        return result

    def rate(self, op: str) -> float:
        return self.calls[op] / self.seconds[op] if self.seconds[op] else float("nan")


def serve(label: str, pool_tokens: int, trace: list[list[int]], timer: Timer):
    """Each request as the scheduler runs it (eval.cachesim.tree.TreeReplay, every SGLang call timed);
    returns the cache and the prefix tokens served from the tree."""
    cache, allocator, step = build(CORES[label], pool_tokens)
    replay = TreeReplay(cache, allocator, timer.run)
    hit_tokens = 0
    for tokens in trace:
        step[0] += 8  # a prefill and a few decode steps per request
        admission = replay.admit(tokens, len(tokens))
        if admission is not None:
            hit_tokens += admission.prefix_len
            replay.finish(admission, tokens)
    return cache, hit_tokens


def bench(label: str, trace: list[list[int]], pool_tokens: int, drain_chunk_tokens: int) -> dict[str, float]:
    """Same tree for every core (no eviction), drained in chunks; then the trace under a small pool."""
    total_tokens = sum(map(len, trace))
    unbounded = Timer(defaultdict(float), defaultdict(int))
    cache, _ = serve(label, total_tokens, trace, unbounded)
    while cache.evictable_size() > 0:
        unbounded.run("drain", cache.evict, EvictParams(num_tokens=drain_chunk_tokens))
    bounded = Timer(defaultdict(float), defaultdict(int))
    start = time.perf_counter()
    _, hit_tokens = serve(label, pool_tokens, trace, bounded)
    return {"match": unbounded.rate("match"), "insert": unbounded.rate("insert"), "admit": unbounded.rate("admit"),
            "drain": unbounded.rate("drain"), "evict": bounded.rate("evict"),
            "requests": len(trace) / (time.perf_counter() - start), "hit_rate": hit_tokens / total_tokens}


def _cell(rate: float, base_rate: float) -> str:
    if math.isnan(rate):  # this core has no such operation
        return f"{'-':>18}"
    ratio = "      " if math.isnan(base_rate) else f"({rate / base_rate:4.2f})"
    return f"{rate:>11.0f} {ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per cell (shared CPUs are noisy)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--pool-tokens", type=int, default=16384)
    parser.add_argument("--drain-chunk-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prepare()
    trace = make_trace(args.requests, args.sessions, args.seed)
    print(f"trace: {len(trace)} requests, {sum(map(len, trace))} tokens; bounded replay pool {args.pool_tokens} tokens")
    runs = [[bench(label, trace, args.pool_tokens, args.drain_chunk_tokens) for label in CORES]
            for _ in range(args.repeats)]
    results = {label: {key: max(run[i][key] for run in runs) for key in runs[0][i]} for i, label in enumerate(CORES)}
    base = results["rust (sglang default)"]
    columns = ("match", "insert", "admit", "drain", "evict", "requests")
    print(f"{'ops/s (x rust)':<24}" + "".join(f"{c:>18}" for c in columns) + f"{'hit rate':>10}")
    for label, row in results.items():
        cells = "".join(_cell(row[c], base[c]) for c in columns)
        print(f"{label:<24}{cells}{row['hit_rate']:>10.3f}")
    print("match/insert/admit: one call per request, no eviction (identical trees); drain: evict "
          f"{args.drain_chunk_tokens}-token chunks until empty; evict/requests/hit rate: the trace replayed "
          f"under the {args.pool_tokens}-token pool (order-dependent: the trees differ)")


if __name__ == "__main__":
    main()
