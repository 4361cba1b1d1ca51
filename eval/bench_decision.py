"""`python -m eval.bench_decision [--sessions S[,S2] --turns T --gap-tokens G --repeats N --radix-sessions
--tree-core python|rust --json OUT]`.

What one VAMP decision costs at a KV shortfall, against stock SGLang's own eviction on a tree of the same shape.
The tree is SGLang's real `UnifiedRadixCache` over our tree core: S multi-turn sessions behind one
shared system prompt, each turn a node (S * T nodes, S leaves), with hits and ages that differ
from node to node. For a G-token gap it times, each at a fresh scheduler step (so no priority is
reused from an earlier measurement):

- `decision`: what the decision maker does before it acts: the eviction candidates taken lazily
  in the tree's order (`radix_eviction.eviction_candidates`), the snapshot, and the plan with all four costs;
  its three parts are also reported alone (`candidates`, `snapshot`, `plan`), so a slow decision says where;
  it runs right after the previous repeat's writes, with the caches of the CPU cold, as at a server's shortfall;
- `decision_warm`: the same decision again at the next step with nothing in between: the CPU caches warm and
  the writes already caught up with (dead heap entries dropped, leaves re-filed), so the gap to `decision` is
  that catch-up and the walk's memory traffic (nodes, their statistics and tensors spread over the heap);
- `sglang_evict`: `tree_cache.evict(G tokens)` alone on stock SGLang: a second tree of the same shape, built by
  the same writes on the same core with SGLang's own cache and its default LRU order, no VAMP code in it (on the
  Rust core its native walk; on the Python core its heap over every evictable leaf);
- `kept_evict`: the same eviction as this tree runs it, from the order it keeps between shortfalls;
- `decision_then_evict`: the decision followed by that eviction, which is what an "evict" plan runs;
- `evict_after_decision`: its eviction part alone (on the Rust core it takes the decision's victims without
  walking the order again: radix_rust.py's `hand_over`).

The default reports two trees: 500 sessions (10,006 nodes) and 5,000 (100,006 nodes, fewer repeats).
`--radix-sessions`: the same trees under SGLang's radix-native sessions (`--enable-session-radix-cache`), every
session's last turn tagged with its session and every other session closed, so the key is SGLang's
(open, refs, the tree's priority) and evictions take the closed sessions' turns.

`--tree-core rust`: the same trees with VAMP's order kept beside SGLang's Rust core (`VampRustTreeCore`,
integration/cache/radix_rust.py); `sglang_evict` is then stock SGLang's default tree, the Rust core with its LRU walk.

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
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.unified_allocator_fixtures import setup_allocator_context
from tqdm import tqdm

from eval.cachesim.tree import tag_session
from vamp_sglang.integration.cache import radix_backend, radix_eviction, radix_tree
from vamp_sglang.policy import Coefficients, OffloadState, Snapshot, plan

SYSTEM_PROMPT_TOKENS = 256
TURN_TOKENS = (16, 48)  # each turn adds this many tokens (uniform)


def build_tree(sessions: int, turns: int, seed: int, radix_sessions: bool = False, tree_core: str = "python",
               vamp: bool = True):
    """The cache, its step counter, and each session's turns (to write evicted ones back). `tree_core`: VAMP's
    order on SGLang's Python core (`VampTreeCore`) or beside its Rust core (`VampRustTreeCore`). `vamp` False:
    stock SGLang on that core with its default LRU order, the same writes (the baseline: no VAMP code at all)."""
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
    if vamp:
        policy, core_backend = radix_backend.NAME, radix_backend.RUST_NAME if tree_core == "rust" else radix_backend.NAME
    else:
        policy, core_backend = "lru", tree_core
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=1, tree_components=(ComponentType.FULL,), eviction_policy=policy,
                             tree_core_backend=core_backend, enable_session_radix_cache=radix_sessions)
    cache = radix_tree.VampUnifiedRadixCache(params) if vamp else UnifiedRadixCache(params)
    step = [0]
    if vamp:
        radix_backend.bind_step_source(cache, lambda: step[0])
    for t in tqdm(range(1, turns + 1), desc=f"building {'VAMP' if vamp else 'stock'} tree (turns)"):
        for history in histories:
            step[0] += 1
            write(cache, allocator, history[t])
            if rng.random() < 0.7 and vamp:  # the next turn reuses this one: count an admission through it
                match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", history[t]))))
                radix_tree.tree_core_of(cache).record_admission(match.last_device_node, match.device_prefix_len,
                                                                len(history[t]), True)
    if radix_sessions:
        for i, history in enumerate(histories):
            session = f"s{i}"
            match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", history[-1]))))
            tag_session(cache, session, match.last_device_node)
            if i % 2:
                cache.release_radix_session(session)
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


def decide(cache, gap_tokens: int, coefficients: Coefficients, parts: dict[str, list[float]] | None = None) -> str:
    """The decision maker's work before acting, on this tree (a prefill shortfall); `parts` gets the
    time of each of its three parts in us."""
    start = time.perf_counter_ns()
    evictable = radix_eviction.eviction_candidates(cache, gap_tokens, 0, 1, 20)
    built = time.perf_counter_ns()
    snapshot = Snapshot("prefill", gap_tokens, 0, tuple(evictable), OFFLOAD, (), 20,
                        radix_tree.tree_core_of(cache).vamp_ledger.hit_rate, coefficients.as_overrides())
    planned = time.perf_counter_ns()
    action = plan(snapshot, coefficients).action
    if parts is not None:
        end = time.perf_counter_ns()
        for name, ns in (("candidates", built - start), ("snapshot", planned - built), ("plan", end - planned)):
            parts[name].append(ns / 1e3)
    return action


def timed_us(fn) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="500,5000", help="one tree per value (comma-separated)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--gap-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200, help="for the first tree; a tenth (>= 20) for larger")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--radix-sessions", action="store_true", help="SGLang's radix-native sessions on, half closed")
    parser.add_argument("--tree-core", choices=("python", "rust"), default="python",
                        help="VAMP's order on SGLang's Python core, or beside its Rust core (sglang_evict: stock SGLang on it)")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    setup_allocator_context()
    radix_backend.install()
    results = []
    for i, sessions in enumerate(int(v) for v in args.sessions.split(",")):
        repeats = args.repeats if i == 0 else max(20, args.repeats // 10)
        results.append(bench_tree(sessions, args.turns, args.gap_tokens, repeats, args.seed, args.radix_sessions,
                                  args.tree_core))
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=2)


def bench_tree(sessions: int, turns: int, gap_tokens: int, repeats: int, seed: int,
               radix_sessions: bool = False, tree_core: str = "python") -> dict:
    if radix_sessions and tree_core == "rust":
        raise ValueError("--radix-sessions needs --tree-core python (SGLang's Rust core has no sessions)")
    cache, allocator, step, histories = build_tree(sessions, turns, seed, radix_sessions, tree_core)
    stock, stock_allocator, _, stock_histories = build_tree(sessions, turns, seed, radix_sessions, tree_core,
                                                            vamp=False)
    core = radix_tree.tree_core_of(cache)
    nodes, leaves = len(core.device_nodes()), len(core.evictable_device_leaves)
    coefficients = Coefficients(t_prefill_s=160e-6)
    names = ("decision", "decision_warm", "sglang_evict", "kept_evict", "decision_then_evict", "evict_after_decision")
    times: dict[str, list[float]] = {name: [] for name in names}
    parts: dict[str, list[float]] = {name: [] for name in ("candidates", "snapshot", "plan")}
    actions = set()

    def kept_evict() -> None:
        cache.evict(EvictParams(num_tokens=gap_tokens))

    for _ in tqdm(range(repeats), desc=f"timing decisions ({nodes} nodes)"):
        step[0] += 1
        times["decision"].append(timed_us(lambda: actions.add(decide(cache, gap_tokens, coefficients, parts))))
        step[0] += 1
        times["decision_warm"].append(timed_us(lambda: decide(cache, gap_tokens, coefficients)))
        times["sglang_evict"].append(timed_us(lambda: stock.evict(EvictParams(num_tokens=gap_tokens))))
        restore(stock, stock_allocator, stock_histories)
        step[0] += 1
        times["kept_evict"].append(timed_us(kept_evict))
        restore(cache, allocator, histories)
        step[0] += 1
        start = time.perf_counter_ns()
        decide(cache, gap_tokens, coefficients)
        decided = time.perf_counter_ns()
        kept_evict()
        end = time.perf_counter_ns()
        times["decision_then_evict"].append((end - start) / 1e3)
        times["evict_after_decision"].append((end - decided) / 1e3)
        restore(cache, allocator, histories)
    stats = {name: summary(samples) for name, samples in times.items()}
    base = stats["sglang_evict"]["median"]
    result = {"nodes": nodes, "evictable_leaves": leaves, "gap_tokens": gap_tokens, "repeats": repeats,
              "radix_sessions": radix_sessions, "tree_core": tree_core, "plans": sorted(actions)}
    for name in names:
        result[f"{name}_us_median"], result[f"{name}_us_p99"] = stats[name]["median"], stats[name]["p99"]
        if name != "sglang_evict":
            result[f"{name}_over_sglang_evict"] = stats[name]["median"] / base
    part_medians = {name: statistics.median(samples) for name, samples in parts.items()}
    result.update({f"decision_{name}_us_median": median for name, median in part_medians.items()})
    print(f"tree: {nodes} nodes, {leaves} evictable leaves; gap {gap_tokens} tokens; plans {sorted(actions)}")
    for name, s in stats.items():
        print(f"  {name:<22} median {s['median']:9.1f} us   p99 {s['p99']:9.1f} us   "
              f"x sglang evict {s['median'] / base:.2f}")
    print("  decision parts (median): " + ", ".join(f"{name} {median:.1f} us" for name, median in part_medians.items()))
    return result


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
