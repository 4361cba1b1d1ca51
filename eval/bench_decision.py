"""`python -m eval.bench_decision [--sessions S --turns T --gap-tokens G --repeats N --json OUT]`.

What one VAMP decision costs at a KV shortfall, against SGLang's own eviction on the same tree.
The tree is SGLang's real `UnifiedRadixCache` over our tree core: S multi-turn sessions behind one
shared system prompt, each turn a node (S * T nodes, S leaves), with hits and ages that differ
from node to node. For a G-token gap it times, each at a fresh scheduler step (so no priority is
reused from an earlier measurement):

- `decision`: what the decision maker does before it acts: the eviction candidates taken lazily
  in the tree's order (`radix_eviction.eviction_candidates`), the snapshot, and the plan with all four costs;
- `sglang_evict`: `tree_cache.evict(G tokens)` alone, as stock SGLang runs it at a shortfall;
- `decision_then_evict`: the decision followed by that eviction, which is what an "evict" plan
  runs (the eviction heap reuses the priorities the decision computed).

After each eviction the evicted turns are written back, so every repeat sees the same tree.
Prints the medians and p99s and their ratio to SGLang's eviction, as JSON too; a script, not a
test, because timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from array import array

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.test.unified_allocator_fixtures import setup_allocator_context
from tqdm import tqdm

from vamp_sglang.integration import radix_backend, radix_eviction, radix_tree
from vamp_sglang.policy import Coefficients, OffloadState, Snapshot, plan

SYSTEM_PROMPT_TOKENS = 256
TURN_TOKENS = (16, 48)  # each turn adds this many tokens (uniform)


def build_tree(sessions: int, turns: int, seed: int):
    """The cache, its step counter, and each session's turns (to write evicted ones back)."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(SYSTEM_PROMPT_TOKENS)]
    histories = [[list(system)] for _ in range(sessions)]
    for history in histories:
        for _ in range(turns):
            history.append(history[-1] + [rng.randrange(32000) for _ in range(rng.randint(*TURN_TOKENS))])
    pool_tokens = sum(len(h[-1]) - SYSTEM_PROMPT_TOKENS for h in histories) + SYSTEM_PROMPT_TOKENS + 4096
    kv = MHATokenToKVPool(size=pool_tokens, page_size=1, dtype=torch.float16, head_num=1, head_dim=4,
                          layer_num=1, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(pool_tokens, torch.float16, "cpu", kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=1, tree_components=(ComponentType.FULL,), eviction_policy=radix_backend.NAME,
                             tree_core_backend=radix_backend.NAME)
    cache = radix_tree.VampUnifiedRadixCache(params)
    step = [0]
    radix_backend.bind_step_source(cache, lambda: step[0])
    core = radix_tree.tree_core_of(cache)
    for t in tqdm(range(1, turns + 1), desc="building tree (turns)"):
        for history in histories:
            step[0] += 1
            write(cache, allocator, history[t])
            if rng.random() < 0.7:  # the next turn reuses this one: count an admission through it
                match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", history[t]))))
                core.record_admission(match.last_device_node, match.device_prefix_len, len(history[t]), True)
    return cache, allocator, step, histories


def write(cache, allocator, tokens: list[int]) -> None:
    """Insert `tokens`, allocating only the part the tree does not hold yet."""
    key = RadixKey(array("q", tokens))
    match = cache.match_prefix(MatchPrefixParams(key=key))
    prefix = cache.path_device_indices(match.last_device_node)[:match.device_prefix_len]
    new = allocator.alloc(len(tokens) - match.device_prefix_len)
    cache.insert(InsertParams(key=key, value=torch.cat([prefix, new]), prev_prefix_len=match.device_prefix_len))


OFFLOAD = OffloadState(headroom_groups=24, tokens_by_groups=tuple(4096 * n for n in range(1, 25)),
                       shards_per_group=4, local_experts=128, top_k=8, decode_budget_min=64)


def decide(cache, gap_tokens: int, coefficients: Coefficients) -> str:
    """The decision maker's work before acting, on this tree (a prefill shortfall)."""
    evictable = radix_eviction.eviction_candidates(cache, gap_tokens, 0, 1, 20)
    snapshot = Snapshot("prefill", gap_tokens, 0, tuple(evictable), OFFLOAD, (), 20,
                        radix_tree.tree_core_of(cache).vamp_ledger.hit_rate, coefficients.as_overrides())
    return plan(snapshot, coefficients).action


def timed_us(fn) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--gap-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    setup_allocator_context()
    radix_backend.install()
    cache, allocator, step, histories = build_tree(args.sessions, args.turns, args.seed)
    core = radix_tree.tree_core_of(cache)
    nodes, leaves = len(core.device_nodes()), len(core.evictable_device_leaves)
    coefficients = Coefficients(t_prefill_s=160e-6)
    times: dict[str, list[float]] = {"decision": [], "sglang_evict": [], "decision_then_evict": []}
    actions = set()

    def sglang_evict() -> None:
        cache.evict(EvictParams(num_tokens=args.gap_tokens))

    for _ in tqdm(range(args.repeats), desc="timing decisions"):
        step[0] += 1
        times["decision"].append(timed_us(lambda: actions.add(decide(cache, args.gap_tokens, coefficients))))
        step[0] += 1
        times["sglang_evict"].append(timed_us(sglang_evict))
        restore(cache, allocator, histories)
        step[0] += 1
        times["decision_then_evict"].append(timed_us(lambda: (decide(cache, args.gap_tokens, coefficients),
                                                             sglang_evict())))
        restore(cache, allocator, histories)
    stats = {name: summary(samples) for name, samples in times.items()}
    result = {
        "nodes": nodes, "evictable_leaves": leaves, "gap_tokens": args.gap_tokens, "repeats": args.repeats,
        "plans": sorted(actions),
        "decision_us_median": stats["decision"]["median"], "decision_us_p99": stats["decision"]["p99"],
        "sglang_evict_us_median": stats["sglang_evict"]["median"],
        "sglang_evict_us_p99": stats["sglang_evict"]["p99"],
        "decision_then_evict_us_median": stats["decision_then_evict"]["median"],
        "decision_over_sglang_evict": stats["decision"]["median"] / stats["sglang_evict"]["median"],
        "decision_then_evict_over_sglang_evict":
            stats["decision_then_evict"]["median"] / stats["sglang_evict"]["median"],
    }
    print(f"tree: {nodes} nodes, {leaves} evictable leaves; gap {args.gap_tokens} tokens; plans {sorted(actions)}")
    for name, s in stats.items():
        print(f"  {name:<22} median {s['median']:9.1f} us   p99 {s['p99']:9.1f} us   "
              f"x sglang evict {s['median'] / stats['sglang_evict']['median']:.2f}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def restore(cache, allocator, histories) -> None:
    """Write every evicted turn back, turn by turn, so each repeat sees a tree of the same shape."""
    for history in histories:
        full = RadixKey(array("q", history[-1]))
        if cache.match_prefix(MatchPrefixParams(key=full)).device_prefix_len == len(history[-1]):
            continue
        for tokens in history[1:]:
            write(cache, allocator, tokens)


if __name__ == "__main__":
    main()
