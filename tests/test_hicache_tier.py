"""integration/cache/hicache_tier.py (issue 22): one host-memory budget, the measured load rate, host-tier hits."""

from types import SimpleNamespace

import pytest
import torch

from vamp_sglang.integration.cache import hicache_tier
from vamp_sglang.integration.cache.hicache_tier import GIB, HostBudgetError, HostTier, check_host_budget


def _host_pool(tokens=64, per_token=32):
    return SimpleNamespace(size=tokens, size_per_token=per_token, kv_buffer=torch.ones(2, tokens, per_token // 8))


def test_the_budget_refusal_names_both_sizes():
    with pytest.raises(HostBudgetError) as err:
        check_host_budget(3 * GIB, 5 * GIB, 0, 4 * GIB)
    message = str(err.value)
    assert "3.00 GiB" in message and "5.00 GiB" in message and "--hicache-ratio" in message
    assert "--vamp-max-offload-ratio" in message
    check_host_budget(3 * GIB, 4 * GIB, 0, 4 * GIB)  # fits exactly
    check_host_budget(3 * GIB, 5 * GIB, 1 * GIB, 4 * GIB)  # 1 GiB of the pool is already resident


def _scheduler(host_pool):
    controller = SimpleNamespace(mem_pool_host=host_pool, write_policy="write_through")
    return SimpleNamespace(tree_cache=SimpleNamespace(cache_controller=controller),
                           token_to_kv_pool_allocator=SimpleNamespace(device="cpu"))


def test_a_pool_sglang_page_locked_is_not_counted_twice(monkeypatch):
    """Issue 48 defect 4: on CUDA SGLang page-locks its host pool (`cudaHostRegister` through its own
    `_cuda_host_register`, here over a stand-in cudart) before VAMP's check runs, and pinning faults every
    page in, so the available memory the check reads already excludes the pool. The machine had room for 1.5 pools
    before, 0.5 after: a start SGLang's own check admitted must start. The same pool not registered (CPU mode)
    is still to come, and against the same available memory it is refused."""
    from sglang.srt.mem_cache import host_memory
    from sglang.srt.mem_cache.pool_host import common

    from vamp_sglang.cpu import hicache as cpu_hicache

    pool_bytes = 4096 * 256
    monkeypatch.setattr(host_memory, "available_host_memory_bytes", lambda **kwargs: pool_bytes // 2)
    monkeypatch.setattr(hicache_tier, "_tier", None)
    monkeypatch.setattr(cpu_hicache, "LOAD_OBSERVERS", [])
    cudart = SimpleNamespace(cudaHostRegister=lambda ptr, size, flags: 0, cudaGetErrorString=str)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pinned = _host_pool(tokens=4096, per_token=256)
    common._cuda_host_register(pinned.kv_buffer)
    runtime = SimpleNamespace(expert_memory=None, extensions=[])
    hicache_tier.setup_scheduler(_scheduler(pinned), runtime)
    assert runtime.host_tier.host_pool_bytes == pool_bytes and runtime.extensions == [runtime.host_tier]
    with pytest.raises(HostBudgetError, match="HiCache's host KV pool"):
        hicache_tier.setup_scheduler(_scheduler(_host_pool(tokens=4096, per_token=256)),
                                     SimpleNamespace(expert_memory=None, extensions=[]))


def test_probe_measures_a_rate_and_hicache_loads_refine_it():
    tier = HostTier(_host_pool(), expert_host_bytes=1000)
    tier.probe("cpu")  # SGLang keeps device names as strings
    assert tier.load_s_per_token is not None and tier.load_s_per_token > 0 and tier.loaded_tokens == 0
    tier.observe_load(100, 1e-3)
    tier.observe_load(0, 1.0)  # nothing loaded: ignored
    assert tier.loaded_tokens == 100
    stats = tier.stats()["hicache"]
    assert stats["host_pool_bytes"] == 64 * 32 and stats["expert_host_bytes"] == 1000
    assert stats["host_bytes_total"] == 64 * 32 + 1000 and stats["load_us_per_token"] > 0


def test_each_request_s_hits_are_counted_once(monkeypatch):
    tier = HostTier(_host_pool(), 0)
    monkeypatch.setattr(hicache_tier, "_tier", tier)
    req = SimpleNamespace(_cache_breakdown_computed=True, cached_tokens_host=40, cached_tokens_device=7)
    fresh = SimpleNamespace(_cache_breakdown_computed=False, cached_tokens_host=0, cached_tokens_device=0)
    batch = SimpleNamespace(reqs=[req, fresh])
    hicache_tier._after_prepare_for_extend(None, batch)
    hicache_tier._after_prepare_for_extend(None, batch)  # a later chunk of the same request
    assert (tier.host_hit_tokens, tier.device_hit_tokens) == (40, 7)


def test_without_hicache_there_is_no_tier():
    assert hicache_tier.host_pool_of(SimpleNamespace(cache_controller=None)) is None
    assert hicache_tier.host_pool_of(SimpleNamespace()) is None


class _Engine:
    def __init__(self):
        self.wait_s = 0.0

    def stats(self):
        return SimpleNamespace(wait_s=self.wait_s)


def _batch(decode, consumer_index=-1, reqs=2, extend_tokens=0):
    mode = SimpleNamespace(is_decode=lambda: decode, is_extend=lambda: not decode)
    return SimpleNamespace(forward_mode=mode, hicache_consumer_index=consumer_index, reqs=[object()] * reqs,
                           extend_num_tokens=extend_tokens)


def test_each_forward_s_staging_wait_is_split_by_whether_its_batch_had_a_host_load(monkeypatch):
    tier = HostTier(_host_pool(), 0)
    engine = _Engine()
    tier.expert_memory = SimpleNamespace(experts=SimpleNamespace(engine=engine), offloaded_groups=1)
    monkeypatch.setattr(hicache_tier, "_tier", tier)
    loaded, plain = _batch(False, 0, reqs=0, extend_tokens=300), _batch(False, -1, reqs=0, extend_tokens=200)
    for batch, waited in ((loaded, 0.004), (plain, 0.002)):
        hicache_tier._after_prepare_for_extend(None, batch)  # SGLang set hicache_consumer_index just before
        engine.wait_s += waited
        hicache_tier._after_run_batch(None, None, batch)
    # the batch goes on decoding with its consumer index still set: no load of its own
    for waited in (0.001, 0.003):
        engine.wait_s += waited
        hicache_tier._after_run_batch(None, None, _batch(True, 0))
    tier.expert_memory.offloaded_groups = 0  # nothing offloaded: no staging to charge, not counted
    hicache_tier._after_prepare_for_extend(None, loaded)
    engine.wait_s += 0.5
    hicache_tier._after_run_batch(None, None, loaded)
    split = tier.stats()["hicache"]["staging_by_load"]
    assert split["extend_with_load"] == {"steps": 1, "staging_wait_s": 0.004, "tokens": 300}
    assert split["extend_without_load"] == {"steps": 1, "staging_wait_s": 0.002, "tokens": 200}
    assert split["decode"] == {"steps": 2, "staging_wait_s": 0.004, "requests": 4}


def test_without_vamp_the_tier_reports_no_staging_split():
    assert "staging_by_load" not in HostTier(_host_pool(), 0).stats()["hicache"]
