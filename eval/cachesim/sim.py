"""One replay of the requests through one policy's tree at one pool size, and the sweep over both.

One request at a time by default: admit, then finish, so the tree holds only finished requests'
KV and the miss-ratio curve and the optimum are well defined. `concurrency` C > 1 replays the
closed-loop schedule (workload.closed_loop) with up to C requests in flight, their prefixes locked
and their new KV allocated outside the tree (so neither can be evicted); requests finish at their
scheduled tick, and one that does not fit waits for the next finish (a session's previous turn
always finishes before its next one is admitted). A request larger than the whole pool runs uncached (all of it missed, nothing inserted).

`close_sessions`: every trace session is an SGLang radix-native session, closed after its last turn
(tree.py), so the tree knows which KV belongs to sessions that ended. The references `opt` and
`bound` know every future use already and run without it; `sweep` reports such a replay beside the
plain one, as "<policy>/closed".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from tqdm import tqdm

from eval.cachesim.bound import simulate_bound
from eval.cachesim.oracle import FutureTrie, LiveLocator, OptStrategy
from eval.cachesim.tree import Admission, TreeReplay, build
from eval.cachesim.workload import SimRequest, decode_steps

DEFAULT_POLICIES = ("lru", "lfu", "slru", "vamp", "opt")
EXTRA_POLICIES = ("bound",)  # the token-granular optimum (bound.py)
KNOWS_THE_FUTURE = ("opt", "bound")  # the references: a session's close tells them nothing
CLOSED = "/closed"  # the suffix of a policy replayed with sessions closed (`sweep`)


def simulate(requests: list[SimRequest], trie: FutureTrie, policy: str, pool_tokens: int,
             concurrency: int = 1, progress: bool = False, close_sessions: bool = False) -> dict[str, float | int]:
    """Token hit rate over turns > 0, re-prefilled tokens (reusable but missed), evicted tokens."""
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1 (got {concurrency})")
    if policy == "bound":
        if concurrency != 1:
            raise ValueError("the bound policy is defined one request at a time (--concurrency 1)")
        return simulate_bound(requests, trie, pool_tokens)
    sessions = close_sessions and policy not in KNOWS_THE_FUTURE
    cache, allocator, step = build(policy, pool_tokens, sessions)
    now = [0]
    if policy == "opt":
        cache.tree_core.eviction_strategy = OptStrategy(trie, LiveLocator(trie, cache.tree_core.root_node),
                                                        lambda: now[0])
    replay = TreeReplay(cache, allocator)
    inflight: deque[tuple[SimRequest, Admission]] = deque()
    running: set[str] = set()
    hits = [0] * len(requests)

    def finish_oldest() -> None:  # the in-flight request the schedule finishes first
        first = min(range(len(inflight)), key=lambda k: inflight[k][0].finish_tick)
        request, admission = inflight[first]
        del inflight[first]
        replay.finish(admission, request.tokens, request.session, close=request.last_turn)  # tags only with sessions
        running.discard(request.session)

    for request in tqdm(requests, desc=f"{policy} @ {pool_tokens}", unit="req", leave=False, disable=not progress):
        now[0] = request.index
        while inflight and min(r.finish_tick for r, _ in inflight) <= request.admit_tick:
            finish_oldest()
        while request.session in running or len(inflight) >= concurrency:
            finish_oldest()
        total = len(request.prompt) + len(request.answer)
        while (admission := replay.admit(request.prompt, total)) is None and inflight:
            finish_oldest()
        if admission is None:  # larger than the pool: served uncached
            if sessions and request.last_turn:
                cache.release_radix_session(request.session)
            continue
        hits[request.index] = admission.prefix_len
        step[0] += decode_steps(request, concurrency)
        inflight.append((request, admission))
        running.add(request.session)
    while inflight:
        finish_oldest()
    later = [r for r in requests if r.turn > 0]
    prompt_tokens, all_prompt_tokens = sum(len(r.prompt) for r in later), sum(len(r.prompt) for r in requests)
    return {"hit_rate": sum(hits[r.index] for r in later) / prompt_tokens if prompt_tokens else 0.0,
            # every turn's prompt, as a server's cache_hit_rate counts it (turn 0 included)
            "hit_rate_all_turns": sum(hits) / all_prompt_tokens if all_prompt_tokens else 0.0,
            "reprefill_tokens": sum(max(0, u - h) for u, h in zip(trie.unbounded_hits, hits)),
            "evictions": replay.evicted_tokens}


def sweep(requests_for: Callable[[int], list[SimRequest]], pools: Iterable[int], policies: Iterable[str],
          concurrency: int = 1, close_sessions: bool = False) -> dict[str, dict[str, dict[str, dict]]]:
    """`{"pools": {"<pool tokens>": {"<policy>": {hit_rate, reprefill_tokens, evictions, vs_opt}}}}`;
    vs_opt is the hit rate over opt's (None when opt is not among the policies). `requests_for(pool)`
    gives the replay order at that pool size (one order for all at concurrency 1). `close_sessions` adds
    "<policy>/closed": each policy but opt and bound again with every session closed after its last turn."""
    pools, policies = list(pools), list(policies)
    tries: dict[int, FutureTrie] = {}
    out: dict[str, dict[str, dict]] = {}
    for pool in tqdm(pools, desc="cachesim pools", unit="pool"):
        requests = requests_for(pool)
        trie = tries.get(id(requests)) or tries.setdefault(id(requests), FutureTrie(requests))
        row = out.setdefault(str(pool), {})
        for policy in policies:
            row[policy] = simulate(requests, trie, policy, pool, concurrency, progress=True)
        for policy in policies if close_sessions else ():
            if policy not in KNOWS_THE_FUTURE:
                row[f"{policy}{CLOSED}"] = simulate(requests, trie, policy, pool, concurrency, progress=True,
                                                    close_sessions=True)
    for row in out.values():
        opt = row.get("opt", {}).get("hit_rate")
        for result in row.values():
            result["vs_opt"] = None if opt is None else (result["hit_rate"] / opt if opt else 1.0)
    return {"pools": out}
