"""Sessions that end at different turns (issue 23), on SGLang's real cache with its radix-native sessions.

Agent sessions end when their task does (the SWE-agent trace: 3 to 21 turns). Until then every policy
must hold a session's KV on an estimate of its next turn, and the estimate cannot tell a session that ended
from one that is late: VAMP keeps an ended session's KV for 1.5 of its reuse intervals (cache/ordering.py),
nearest expected use last, while the offline optimum drops it at once. A client that closes its session
(SGLang's `/close_session`, `--enable-session-radix-cache`) tells the tree; `eval.cachesim --close-sessions`
replays that, and SGLang then evicts KV of no open session first, then KV fewer open sessions hold, each
in the tree's own order.
"""

import json
import random

import pytest
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from eval.cachesim import __main__ as cli
from eval.cachesim.oracle import FutureTrie
from eval.cachesim.sim import simulate
from eval.cachesim.tree import TreeReplay, build, prepare
from eval.cachesim.workload import build_requests
from eval.trace_format import TraceRequest, dump_trace
from vamp_sglang.integration.cache import radix_backend

BLOCK_TOKENS, FIRST_BLOCKS, GROWTH_BLOCKS, OUTPUT_TOKENS = 32, 8, 2, 16
ACTIVE_SESSIONS = 8  # taking turns round-robin; a session that ends is replaced by the next


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    prepare()


def ending_sessions(seed: int, sessions: int = 24, turns: tuple[int, int] = (2, 14)) -> list[TraceRequest]:
    """Sessions of 2-14 turns: 256-token first turns, each later turn 64 tokens more."""
    rng = random.Random(seed)
    trace = []
    for s in range(sessions):
        blocks = [10_000 * s + k for k in range(FIRST_BLOCKS)]
        for t in range(rng.randint(*turns)):
            if t:
                blocks = blocks + [10_000 * s + 100 + 10 * t + k for k in range(GROWTH_BLOCKS)]
            trace.append(TraceRequest(f"s{s}", t, 0.0 if t == 0 else None, None, len(blocks) * BLOCK_TOKENS,
                                      OUTPUT_TOKENS, tuple(blocks), BLOCK_TOKENS))
    return trace


@pytest.fixture(scope="module")
def rates():
    requests = build_requests(ending_sessions(2), ACTIVE_SESSIONS)
    trie = FutureTrie(requests)
    pool = trie.reusable_tokens // 4
    return {(policy, closed): simulate(requests, trie, policy, pool, close_sessions=closed)["hit_rate"]
            for policy, closed in (("opt", False), ("vamp", False), ("vamp", True), ("lru", True))}


def test_closed_sessions_bring_vamp_within_95_percent_of_the_optimum(rates):
    assert rates["vamp", True] >= 0.95 * rates["opt", False], rates


def test_the_close_alone_does_not_do_it(rates):
    """LRU gets the same close and stays far below: among open sessions the order is still the policy's."""
    assert rates["lru", True] < 0.85 * rates["vamp", True], rates


@pytest.mark.xfail(strict=True, reason="not met without the close: 0.74 of opt (docs/evaluation.md)")
def test_without_the_close_vamp_comes_within_95_percent(rates):
    assert rates["vamp", False] >= 0.95 * rates["opt", False], rates


def test_a_closed_session_holds_no_reference_and_an_open_one_does():
    cache, allocator, _ = build("vamp", 1024, sessions=True)
    replay = TreeReplay(cache, allocator)
    full = cache.tree_core.components_by_type[ComponentType.FULL]

    def refs():
        return {node.key.token_ids[0]: full.session_ref(node) for node in cache.tree_core.evictable_device_leaves}

    for session, first in (("a", 1), ("b", 500)):
        prompt = list(range(first, first + 100))
        admission = replay.admit(prompt, 110)
        replay.finish(admission, prompt + list(range(9000 + first, 9010 + first)), session)
    assert refs() == {1: 1, 500: 1}
    assert radix_backend.radix_stats(cache)["open_session_tokens"] == 2 * 110
    admission = replay.admit(list(range(1, 101)), 120)  # a's last turn: its history and 10 new tokens
    replay.finish(admission, list(range(1, 101)) + list(range(9001, 9011)) + list(range(7000, 7010)), "a",
                  close=True)
    assert refs() == {7000: 0, 500: 1}  # the turn's new KV is the leaf now; closed, nothing holds it
    assert radix_backend.radix_stats(cache)["open_session_tokens"] == 110  # /vamp/stats: b's alone


def test_cli_reports_each_policy_closed_beside_it_in_the_closed_loop_too(tmp_path):
    dump_trace(ending_sessions(2), tmp_path / "t.jsonl")
    cli.main(["--trace", str(tmp_path / "t.jsonl"), "--pool-tokens", "0.25x", "--policies", "lru,vamp,opt",
              "--concurrency", "2", "--sessions", str(ACTIVE_SESSIONS), "--close-sessions",
              "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")])
    (row,) = json.loads((tmp_path / "out.json").read_text())["pools"].values()
    assert list(row) == ["lru", "vamp", "opt", "lru/closed", "vamp/closed"]  # the optimum knows every end already
    assert row["vamp/closed"]["hit_rate"] > row["vamp"]["hit_rate"], row
    assert row["vamp/closed"]["vs_opt"] == row["vamp/closed"]["hit_rate"] / row["opt"]["hit_rate"]
    assert (tmp_path / "out.png").stat().st_size > 0
