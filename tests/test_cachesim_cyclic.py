"""Sessions taking turns round-robin in a pool too small for all of them (issue 23), on SGLang's real cache.

Every session's next turn comes after all the others', so the session served longest ago is the one
needed next: an order by recency (SGLang's LRU, and Eq. 1's p_eff alone, which falls with idle time)
evicts exactly it, and hits nothing. The offline optimum keeps a fixed subset of sessions whole. VAMP's
expected-next-use order (cache/ordering.py) must come within 95% of it, as the issue's target asks.
"""

import pytest

from eval.cachesim.oracle import FutureTrie
from eval.cachesim.sim import simulate
from eval.cachesim.tree import prepare
from eval.cachesim.workload import build_requests
from eval.multiturn import MultiTurnSpec, generate_multiturn


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    prepare()


@pytest.mark.parametrize("shared_prefix_tokens, fraction", [
    (0, 0.25), (0, 0.5), (64, 0.5),
    # a shared system prompt gives first turns a hit rate, so their KV is expected back from the start and
    # the just-served session's new KV goes first: sessions keep their first turns, where opt keeps fewer, whole
    pytest.param(64, 0.25, marks=pytest.mark.xfail(strict=True, reason="not met: 0.87 of opt (docs/evaluation.md)")),
])
def test_round_robin_sessions_keep_what_the_optimum_keeps(shared_prefix_tokens, fraction):
    trace = generate_multiturn(MultiTurnSpec(sessions=8, turns=8, first_turn_tokens=256, turn_growth_tokens=64,
                                             output_tokens=16, block_tokens=32,
                                             shared_prefix_tokens=shared_prefix_tokens))
    requests = build_requests(trace, None)
    trie = FutureTrie(requests)
    pool = int(trie.reusable_tokens * fraction)
    opt, lru, vamp = (simulate(requests, trie, policy, pool)["hit_rate"] for policy in ("opt", "lru", "vamp"))
    assert lru < 0.5 * opt, f"LRU kept {lru:.3f} of opt's {opt:.3f}: not a cyclic workload"
    assert vamp >= 0.95 * opt, f"at {fraction:.0%} of the footprint VAMP hit {vamp:.3f}, opt {opt:.3f}"
