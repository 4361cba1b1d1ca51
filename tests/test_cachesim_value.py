"""The two properties of VAMP's eviction value the issue asks for (issue 23), on SGLang's real cache:
request priority (InsertParams.priority) orders before p_eff, and a match without an admission
leaves the value (recency included) untouched."""

from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from eval.cachesim.tree import build, prepare
from vamp_sglang.integration.cache import radix_tree


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    prepare()


def key(tokens):
    return RadixKey(array("q", tokens))


def insert(cache, allocator, tokens, priority=0):
    match = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    prefix = cache.path_device_indices(match.last_device_node)[:match.device_prefix_len]
    new = allocator.alloc(len(tokens) - match.device_prefix_len)
    cache.insert(InsertParams(key=key(tokens), value=torch.cat([prefix, new]), prev_prefix_len=len(prefix),
                              priority=priority))


def admit(cache, tokens):
    match = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    radix_tree.tree_core_of(cache).record_admission(match.last_device_node, match.device_prefix_len,
                                                    len(tokens), True)


def leaf(cache, tokens):
    match = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    return cache.tree_core.node_by_id(match.last_device_node)


def first_evicted(cache, candidates):
    """Which of the `candidates` (token lists) an eviction of one node takes."""
    before = {tuple(c): leaf(cache, c).id for c in candidates}
    cache.evict(EvictParams(num_tokens=1))
    gone = [c for c in candidates if leaf(cache, c).id != before[tuple(c)]]
    assert len(gone) == 1
    return gone[0]


HOT, COLD = [1, 2, 3, 4], [7, 8, 9, 10]


def test_a_user_priority_protects_a_cold_prefix_over_a_hot_one():
    cache, allocator, step = build("vamp", 64)
    insert(cache, allocator, HOT, priority=0)
    insert(cache, allocator, COLD, priority=5)
    for _ in range(3):
        step[0] += 1
        admit(cache, HOT)  # HOT has hits and is recent: p_eff alone would evict COLD
    assert first_evicted(cache, [HOT, COLD]) == HOT


def test_without_priorities_the_order_is_p_eff_and_a_raised_priority_is_seen_at_once():
    cache, allocator, step = build("vamp", 64)
    insert(cache, allocator, HOT)
    insert(cache, allocator, COLD)
    step[0] += 1
    admit(cache, HOT)
    core = cache.tree_core
    assert core.vamp_priority(leaf(cache, COLD)) < core.vamp_priority(leaf(cache, HOT))
    insert(cache, allocator, COLD, priority=3)  # the same step: the memoised priority must not hide it
    assert core.vamp_priority(leaf(cache, COLD)) > core.vamp_priority(leaf(cache, HOT))
    assert first_evicted(cache, [HOT, COLD]) == HOT


def _two_admitted_prefixes():
    cache, allocator, step = build("vamp", 64)
    insert(cache, allocator, COLD)
    admit(cache, COLD)  # one hit, so its p_eff is above 0
    step[0] += 1
    insert(cache, allocator, HOT)
    admit(cache, HOT)
    return cache


def test_a_match_not_followed_by_an_admission_leaves_the_value_untouched():
    cache, untouched = _two_admitted_prefixes(), _two_admitted_prefixes()
    core = cache.tree_core
    cold = leaf(cache, COLD)
    before, sglang_time, stats = core.vamp_priority(cold), cold.last_access_time, repr(cold.vamp_stats)
    for _ in range(5):  # a waiting request is re-matched every scheduling round (here within one step)
        cache.match_prefix(MatchPrefixParams(key=key(COLD)))
    core.vamp_priorities.clear()  # price afresh, not from the memo
    assert cold.last_access_time > sglang_time  # SGLang's LRU clock moved ...
    assert core.vamp_priority(cold) == before and repr(cold.vamp_stats) == stats  # ... VAMP's value did not
    # so the eviction is the one a tree that saw no matches makes
    assert first_evicted(cache, [HOT, COLD]) == first_evicted(untouched, [HOT, COLD])
