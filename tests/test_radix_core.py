"""Targeted checks of VampTreeCore in SGLang's real cache: registration, stats life cycle, order."""

import argparse
import math

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.runtime_context import publish, reset_context
from sglang.srt.server_args import ServerArgs

from tests.test_radix_tree_state import build_cache, key_of, sglang_context  # noqa: F401 (fixture)
from vamp_sglang.integration.cache import radix_backend, radix_eviction, radix_tree
from vamp_sglang.integration.cache.radix_rust import VampRustTreeCore
from vamp_sglang.policy import EvictableBlock


def insert(cache, allocator, tokens):
    cache.insert(InsertParams(key=key_of(tokens), value=allocator.alloc(len(tokens))))


def admit(cache, tokens):
    match = cache.match_prefix(MatchPrefixParams(key=key_of(tokens)))
    radix_tree.tree_core_of(cache).record_admission(match.last_device_node, match.device_prefix_len, len(tokens),
                                               first=True)


def node_for(cache, tokens):
    match = cache.match_prefix(MatchPrefixParams(key=key_of(tokens)))
    return radix_tree.tree_core_of(cache).node_by_id(match.last_device_node)


def test_registries_build_our_tree_from_server_flags():
    radix_backend.install()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "dummy", "--radix-cache-backend", "vamp", "--radix-eviction-policy", "vamp"])
    args = ServerArgs(model_path="dummy", device="cpu", radix_cache_backend=ns.radix_cache_backend,
                      radix_eviction_policy=ns.radix_eviction_policy)
    reset_context()
    publish(args, role="tokenizer")
    _, allocator = build_cache(page_size=1)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=1, eviction_policy="vamp")
    cache = create_tree_cache(TreeCacheBuildContext(
        server_args=args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
        disable_radix_cache=False, tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None))
    assert type(cache) is radix_tree.VampUnifiedRadixCache
    assert type(cache.tree_core) is VampRustTreeCore  # --vamp-tree-core auto: SGLang's Rust core carries the order
    params.enable_session_radix_cache = True  # which its Rust core cannot hold: the Python core then
    cache = create_tree_cache(TreeCacheBuildContext(
        server_args=args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
        disable_radix_cache=False, tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None))
    assert type(cache.tree_core) is radix_tree.VampTreeCore
    assert type(cache.tree_core.eviction_strategy) is radix_tree.VampStrategy


def test_install_is_idempotent():
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES

    radix_backend.install()
    radix_backend.install()
    assert RADIX_EVICTION_POLICY_CHOICES.count("vamp") == 1


def test_policy_without_our_tree_fails_with_a_clear_error():
    with pytest.raises(RuntimeError, match="needs --radix-cache-backend vamp"):
        radix_tree.VampStrategy().get_priority(object())
    cache, _ = build_cache(page_size=1, policy="lru")
    with pytest.raises(TypeError, match="--radix-cache-backend vamp"):
        radix_backend.radix_stats(type("Plain", (), {"tree_core": object()})())
    assert radix_backend.radix_stats(cache)["node_count"] == 0  # our core under the stock LRU order is fine


def test_split_keeps_stats_and_insert_refreshes_recency():
    cache, allocator = build_cache(page_size=1)
    core = radix_tree.tree_core_of(cache)
    step = [7]
    radix_backend.bind_step_source(cache, lambda: step[0])
    with core.written_by(0.8):
        insert(cache, allocator, list(range(10)))
    admit(cache, list(range(10)))
    step[0] = 50
    insert(cache, allocator, [0, 1, 2, 3, 99])  # splits [0..9] into [0..3] + [4..9]
    prefix, tail = node_for(cache, [0, 1, 2, 3]), node_for(cache, list(range(10)))
    assert tail.parent is prefix
    assert (prefix.vamp_stats.hits, tail.vamp_stats.hits) == (1, 1)
    assert prefix.vamp_stats.prior == tail.vamp_stats.prior == 0.8
    assert prefix.vamp_stats.last_step == 50  # the insert wrote through it
    assert tail.vamp_stats.created_step == prefix.vamp_stats.created_step == 7
    branch = node_for(cache, [0, 1, 2, 3, 99]).vamp_stats
    assert (branch.created_step, branch.prior) == (50, None)


def history(cache, allocator, writer_rate, reused, rounds=40):
    """`rounds` earlier 32-token writes by requests that hit `writer_rate`, each reused by one admission
    or never, then evicted: what the tree has observed of KV from that writer class."""
    core = radix_tree.tree_core_of(cache)
    for k in range(rounds):
        tokens = list(range(10_000 + 100 * k, 10_032 + 100 * k))
        with core.written_by(writer_rate):
            insert(cache, allocator, tokens)
        if reused:
            admit(cache, tokens)
        cache.evict(EvictParams(num_tokens=64))


def test_a_fresh_continuation_outlives_a_newer_one_shot_prompt_where_one_shots_were_not_reused():
    cache, allocator = build_cache(page_size=1)
    core = radix_tree.tree_core_of(cache)
    step = [0]
    radix_backend.bind_step_source(cache, lambda: step[0])
    history(cache, allocator, 0.9, reused=True)  # continuations were continued
    history(cache, allocator, 0.0, reused=False)  # one-shot prompts never came back
    shares = core.vamp_shares
    assert shares.written_tokens[3] == shares.reused_tokens[3] == 1280 and shares.reused_tokens[0] == 0
    with core.written_by(0.9):  # a session turn that hit 90% wrote its new tail
        insert(cache, allocator, list(range(500, 520)))
    step[0] = 10
    with core.written_by(0.0):  # then a one-shot prompt arrived
        insert(cache, allocator, list(range(600, 620)))
    one_shot_prior, continuation_prior = core.prior_hit_rate(node_for(cache, list(range(600, 620)))), \
        core.prior_hit_rate(node_for(cache, list(range(500, 520))))
    # priced with their classes' observed shares, shrunk towards the tree-wide rate (every admission hit: 1.0),
    # as published: within one publishing step (2^(1/8)) of the share itself
    assert shares.share(0, 1.0) == pytest.approx(1024 / (1300 + 1024))
    assert abs(math.log2(one_shot_prior / shares.share(0, 1.0))) <= 1 / 8
    assert continuation_prior == pytest.approx(1.0)
    # in the tree's order; lazily: enough to cover the need only
    assert radix_eviction.eviction_candidates(cache, 40, 0, 1, 0) == [
        EvictableBlock(20, 0, 0, one_shot_prior), EvictableBlock(20, 0, 10, continuation_prior)]
    assert radix_eviction.eviction_candidates(cache, 5, 0, 1, 0) == [EvictableBlock(20, 0, 0, one_shot_prior)]
    cache.evict(EvictParams(num_tokens=1))
    assert node_for(cache, list(range(500, 520))).vamp_stats.prior == 0.9  # still cached
    assert cache.match_prefix(MatchPrefixParams(key=key_of(list(range(600, 620))))).device_prefix_len == 0


def test_a_first_turn_outlives_stale_reused_kv_where_first_turns_are_continued():
    """The Mooncake case (docs/evaluation.md): first turns hit ~0 of their prompt, yet their sessions come
    back. Priced by the writer's own rate they went first, below any stale node ever hit; priced by what
    the tree observed of first turns, a fresh one outlives KV whose sessions ended long ago."""
    cache, allocator = build_cache(page_size=1)
    core = radix_tree.tree_core_of(cache)
    step = [0]
    radix_backend.bind_step_source(cache, lambda: step[0])
    history(cache, allocator, 0.0, reused=True)  # first turns were continued
    with core.written_by(0.9):
        insert(cache, allocator, list(range(500, 520)))
    admit(cache, list(range(500, 520)))  # reused once, then its session ended
    step[0] = 20_000
    with core.written_by(0.0):
        insert(cache, allocator, list(range(600, 620)))
    cache.evict(EvictParams(num_tokens=1))
    assert cache.match_prefix(MatchPrefixParams(key=key_of(list(range(500, 520))))).device_prefix_len == 0
    assert cache.match_prefix(MatchPrefixParams(key=key_of(list(range(600, 620))))).device_prefix_len == 20


def test_kv_an_insert_gives_back_to_a_host_only_node_counts_for_that_nodes_writer():
    """HiCache: a host-only node re-filled by an insert keeps its first writer and its class; its tokens are not
    written again by the request inserting now (the host copy is attached by hand, as write-through would)."""
    cache, allocator = build_cache(page_size=1)
    core = radix_tree.tree_core_of(cache)
    tokens = list(range(100, 120))
    with core.written_by(0.0):  # a first turn writes 20 tokens
        insert(cache, allocator, tokens)
    node = node_for(cache, tokens)
    node.component_data[ComponentType.FULL].host_value = torch.arange(20)
    cache.evict(EvictParams(num_tokens=20))
    assert node.evicted and node.backuped
    with core.written_by(0.9):  # a continuation re-prefills them; the insert gives the node its device KV back
        insert(cache, allocator, tokens)
    assert not node.evicted and node.vamp_stats.prior == 0.0
    admit(cache, tokens + [1])
    assert core.vamp_shares.written_tokens == [20, 0, 0, 0]
    assert core.vamp_shares.reused_tokens == [20, 0, 0, 0]


def scenario(policy: str) -> tuple[set, dict]:
    """A 16-token session prefix reused three times, then 16-token one-shot prompts fill the pool."""
    cache, allocator = build_cache(page_size=1, policy=policy)
    step = [0]
    radix_backend.bind_step_source(cache, lambda: step[0])
    session = list(range(1000, 1016))
    insert(cache, allocator, session)
    for _ in range(3):
        step[0] += 5
        admit(cache, session)
    one_shots = [list(range(k * 100, k * 100 + 16)) for k in range(3)]
    for prompt in one_shots:
        step[0] += 10
        admit(cache, prompt)
        insert(cache, allocator, prompt)
    predicted = radix_eviction.eviction_plan(cache, 16)
    cache.evict(EvictParams(num_tokens=16))
    kept = {name for name, tokens in [("session", session)] + [(f"one-shot {i}", p) for i, p in enumerate(one_shots)]
            if cache.match_prefix(MatchPrefixParams(key=key_of(tokens))).device_prefix_len == len(tokens)}
    return kept, {"predicted": predicted, "stats": radix_backend.radix_stats(cache)}


def test_cost_order_keeps_the_reused_session_where_lru_evicts_it():
    kept_vamp, info = scenario("vamp")
    kept_lru, _ = scenario("lru")
    assert kept_vamp == {"session", "one-shot 1", "one-shot 2"}
    assert kept_lru == {"one-shot 0", "one-shot 1", "one-shot 2"}
    assert info["predicted"].tokens == 16 and info["stats"]["evicted_tokens"] == 16


def test_radix_stats_report_sizes_reuse_and_evictions_only():
    _, info = scenario("vamp")
    stats = info["stats"]
    assert set(stats) == {"tree_core", "node_count", "cached_tokens", "evictable_tokens", "protected_tokens", "admissions",
                          "hit_tokens", "requested_tokens", "hit_rate", "hits_histogram", "age_histogram_steps",
                          "evicted_tokens", "reuse_by_writer_hit_rate"}
    assert stats["tree_core"] == "python"  # scenario() builds VampTreeCore itself
    assert (stats["node_count"], stats["cached_tokens"], stats["evictable_tokens"]) == (3, 48, 48)
    assert (stats["admissions"], stats["hit_tokens"], stats["requested_tokens"]) == (6, 48, 96)
    assert stats["hits_histogram"]["2-3"] == 1 and stats["hits_histogram"]["0"] == 2
    assert sum(stats["age_histogram_steps"].values()) == 3
    # every write here came from no known writer (no checkpoint_into_tree): no class has evidence
    assert all(row["written_tokens"] == row["reused_tokens"] == 0 for row in stats["reuse_by_writer_hit_rate"].values())
    candidates = radix_eviction.eviction_candidates(radix_cache := build_cache(1)[0], 5, 0, 1, 20)
    assert candidates == [] and radix_eviction.estimate_eviction(radix_cache, 10) == (0, 0.0)
