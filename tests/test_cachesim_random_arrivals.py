"""Sessions arriving at random among one-shot prompts (issue 23's held-out check), on SGLang's real cache.

`eval.bench_tree`'s trace: half the requests continue one of 16 sessions chosen at random, half are one-shot
prompts never seen again. A session's next turn often comes later than its mean gap, so its KV is overdue and
goes by p_eff, first; one-shot KV, whose writer class (a first turn's) is reused now and then, has a small
positive prior. Held as expected back, that KV took the pool from the sessions (VAMP hit about what LRU hits);
below `EXPECTED_MIN_REUSE` it goes by p_eff, before the sessions it would otherwise outlive.
"""

import pytest

from eval.bench_tree import make_trace
from eval.cachesim.oracle import FutureTrie
from eval.cachesim.sim import simulate
from eval.cachesim.tree import prepare
from eval.cachesim.workload import SimRequest

POOL_TOKENS = 16384  # bench_tree's bounded replay


@pytest.fixture(scope="module")
def rates():
    prepare()
    requests = [SimRequest(i, str(i), 1, tokens, []) for i, tokens in enumerate(make_trace(1000, 16, 0))]
    trie = FutureTrie(requests)
    return {policy: simulate(requests, trie, policy, POOL_TOKENS)["hit_rate"] for policy in ("lru", "vamp", "opt")}


def test_one_shot_prompts_do_not_crowd_out_sessions(rates):
    assert rates["lru"] < rates["opt"]
    assert rates["vamp"] >= 1.1 * rates["lru"], rates


@pytest.mark.xfail(strict=True, reason="not met: 0.79 of opt (docs/evaluation.md)")
def test_random_arrivals_come_within_95_percent_of_the_optimum(rates):
    assert rates["vamp"] >= 0.95 * rates["opt"], rates
