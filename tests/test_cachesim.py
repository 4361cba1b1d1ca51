"""eval.cachesim: the request order, the oracle, SGLang's policies replayed, the optima, concurrency, the CLI."""

import json
import random
from itertools import pairwise

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from eval.cachesim import __main__ as cli
from eval.cachesim.oracle import FutureTrie
from eval.cachesim.sim import simulate, sweep
from eval.cachesim.tree import TreeReplay, build, prepare
from eval.cachesim.workload import SimRequest, build_requests, interleave
from eval.trace_format import TraceRequest, dump_trace


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    prepare()


def turn(session, t, blocks, block=2, out=1):
    return TraceRequest(session, t, 0.0 if t == 0 else None, None, len(blocks) * block, out, tuple(blocks), block)


def random_trace(rng, sessions=3, turns=3):
    trace = []
    for s in range(sessions):
        blocks = [rng.randrange(3)]  # a first block some sessions share
        for t in range(turns):
            blocks = blocks + [1000 * s + 10 * t + k for k in range(rng.randint(1, 2))]
            trace.append(turn(f"s{s}", t, blocks, out=rng.randint(1, 2)))
    return trace


def total_hits(requests, trie, policy, pool, concurrency=1):
    """Token hits over all requests (what an optimum maximises), from the reported re-prefill."""
    return sum(trie.unbounded_hits) - simulate(requests, trie, policy, pool, concurrency)["reprefill_tokens"]


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_requests_interleave_round_robin_over_the_active_sessions():
    trace = [turn("a", 0, [1]), turn("a", 1, [1, 2]), turn("a", 2, [1, 2, 3]),
             turn("b", 0, [5]), turn("c", 0, [7]), turn("c", 1, [7, 8])]
    assert [(r.session, r.turn) for r in interleave(trace, 2)] == [
        ("a", 0), ("b", 0), ("a", 1), ("c", 0), ("a", 2), ("c", 1)]
    assert [(r.session, r.turn) for r in interleave(trace, None)] == [
        ("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]


def test_a_later_turn_extends_the_previous_prompt_and_answer():
    requests = build_requests([turn("a", 0, [1, 2]), turn("a", 1, [1, 2, 3, 4])], None)
    first, second = requests
    assert second.prompt[:len(first.tokens)] == first.tokens and len(second.prompt) == 8
    assert first.answer != second.answer


def test_the_oracle_agrees_with_brute_force_prefixes():
    requests = build_requests(random_trace(random.Random(3), sessions=4), 2)
    trie = FutureTrie(requests)
    for r in requests:
        assert trie.unbounded_hits[r.index] == max([lcp(r.prompt, w.tokens) for w in requests[:r.index]], default=0)
    # reusable footprint: distinct token positions (prefixes) some earlier request wrote and a later one read
    reused = {tuple(r.prompt[:k + 1]) for r in requests for k in range(trie.unbounded_hits[r.index])}
    assert trie.reusable_tokens == len(reused)


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "vamp", "opt", "bound"])
def test_a_pool_holding_everything_serves_every_reusable_token(policy):
    requests = build_requests(random_trace(random.Random(5)), 2)
    trie = FutureTrie(requests)
    pool = sum(len(r.tokens) for r in requests)
    result = simulate(requests, trie, policy, pool)
    assert result["reprefill_tokens"] == 0 and result["evictions"] == 0


@pytest.mark.parametrize("policy", ["lru", "slru"])
def test_the_simulated_order_is_sglangs_on_both_of_its_tree_cores(policy):
    """The Rust core the sim uses for SGLang's policies and SGLang's Python core evict alike."""
    for seed in range(4):
        requests = build_requests(random_trace(random.Random(seed), sessions=4), 4)
        trie = FutureTrie(requests)
        pool = max(len(r.tokens) for r in requests) + 4
        rust, python = (simulate(requests, trie, p, pool) for p in (policy, f"python:{policy}"))
        assert rust == python
        assert rust["evictions"] > 0


def node_optimum(requests, pool):
    """Best total hits over every sequence of whole-leaf evictions (SGLang's tree, depth-first over scripts)."""
    best, scripts = -1, [[]]

    class Branch(Exception):
        pass

    while scripts:
        script, choices = scripts.pop(), [0]
        cache, allocator, _ = build("python:lru", pool)
        core = cache.tree_core
        full = core.components_by_type[ComponentType.FULL]

        def call(op, fn, *args, script=script, choices=choices, core=core, full=full):
            if op != "evict":
                return fn(*args)
            freed = 0
            while freed < args[0].num_tokens and core.evictable_device_leaves:
                leaves = sorted(core.evictable_device_leaves, key=lambda n: n.id)
                if choices[0] == len(script):
                    raise Branch(len(leaves))
                target = leaves[script[choices[0]]]
                choices[0] += 1
                full.session_ref_eviction_strategy = lambda n, t=target: (n is not t, n.id)
                freed += fn(EvictParams(num_tokens=1)).num_tokens_evicted
            return type("Freed", (), {"num_tokens_evicted": freed})

        replay, hits = TreeReplay(cache, allocator, call), 0
        try:
            for r in requests:
                admission = replay.admit(r.prompt, len(r.tokens))
                if admission is not None:
                    hits += admission.prefix_len
                    replay.finish(admission, r.tokens)
        except Branch as branch:
            scripts += [script + [i] for i in range(branch.args[0])]
            continue
        best = max(best, hits)
    return best


def test_optima_order_against_brute_force_and_every_policy():
    """bound >= the best whole-leaf eviction sequence >= every policy, opt (Belady on leaves) included. This
    catches accounting (hits counted that were not served, a larger pool), not a wrong leaf or a bound too
    high: tests/test_cachesim_exact.py and the equal-size test below pin those."""
    for seed in range(10):
        rng = random.Random(seed)
        requests = build_requests(random_trace(rng), 3)
        trie = FutureTrie(requests)
        pool = max(len(r.tokens) for r in requests) + rng.randint(0, 4)
        best = node_optimum(requests, pool)
        bound = total_hits(requests, trie, "bound", pool)
        assert bound >= best
        for policy in ("lru", "lfu", "slru", "vamp", "opt"):
            assert total_hits(requests, trie, policy, pool) <= best, policy


def test_opt_and_the_bound_are_the_brute_force_optimum_on_equal_sized_independent_prompts():
    """Classic paging (Belady is optimal there): distinct prompts of one size, a pool of a few. With whole
    prompts in a pool that holds a whole number of them the token-granular problem is the leaf-granular one
    (a prompt's tokens share their next use, and keeping part of one serves nothing more than keeping it
    whole would), so the bound is the optimum too, not just above it."""
    for seed in range(12):
        rng = random.Random(seed)
        prompts = [[100 * k + j for j in range(3)] for k in range(4)]
        requests = [SimRequest(i, f"s{i}", 0, list(prompts[rng.randrange(4)]), []) for i in range(8)]
        trie = FutureTrie(requests)
        pool = 3 * rng.choice((1, 2, 3))
        best = node_optimum(requests, pool)
        bound = total_hits(requests, trie, "bound", pool)
        assert total_hits(requests, trie, "opt", pool) == best == bound, seed


def test_in_flight_requests_are_not_in_the_tree_yet():
    """Two sessions behind one system prompt: with both in flight the second cannot reuse the first's KV."""
    trace = [turn("a", 0, [1, 2]), turn("b", 0, [1, 3]), turn("a", 1, [1, 2, 4]), turn("b", 1, [1, 3, 5])]
    requests = build_requests(trace, None)
    one = simulate(requests, FutureTrie(requests), "lru", 1000, concurrency=1)["reprefill_tokens"]
    both = build_requests(trace, None, 2, 1000)
    assert [(r.session, r.turn, r.admit_tick) for r in both][:2] == [("a", 0, 0), ("b", 0, 0)]
    two = simulate(both, FutureTrie(both), "lru", 1000, concurrency=2)["reprefill_tokens"]
    assert one == 0 and two == 2  # b's turn 0 missed the 2 system-prompt tokens a was still holding
    # a pool that fits one request at a time runs them one by one: the closed loop waits for room
    tight = max(len(r.tokens) for r in requests)
    serial = build_requests(trace, None, 2, tight)
    assert all(r.admit_tick >= p.finish_tick for p, r in pairwise(serial))
    trie = FutureTrie(serial)
    assert simulate(serial, trie, "lru", tight, concurrency=2) == simulate(serial, trie, "lru", tight)


def test_cli_writes_the_documented_json_and_plot(tmp_path, capsys):
    trace = random_trace(random.Random(1), sessions=4)
    dump_trace(trace, tmp_path / "t.jsonl")
    cli.main(["--trace", str(tmp_path / "t.jsonl"), "--pool-tokens", "0.5x,1x,400", "--policies",
              "lru,vamp,opt", "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")])
    result = json.loads((tmp_path / "out.json").read_text())
    assert list(result) == ["pools"] and len(result["pools"]) == 3
    for row in result["pools"].values():
        assert list(row) == ["lru", "vamp", "opt"]
        assert all(set(r) == {"hit_rate", "hit_rate_all_turns", "reprefill_tokens", "evictions", "vs_opt"}
                   for r in row.values())
        assert all(0.0 <= r["hit_rate_all_turns"] <= 1.0 for r in row.values())
        assert row["opt"]["vs_opt"] == 1.0
    assert (tmp_path / "out.png").stat().st_size > 0
    requests = build_requests(trace, None)
    assert sweep(lambda pool: requests, [50], ["lru"])["pools"]["50"]["lru"]["vs_opt"] is None
