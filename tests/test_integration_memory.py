"""Expert memory becomes KV memory on SGLang's own objects, in one process and on real host pages.

A real `MHATokenToKVPool` is built through our `_create_buffers_normal` hook, served by a real
`TokenToKVPoolAllocator` (or the paged one), and grown and shrunk by `ExpertMemory` with pages taken
from three real `FusedMoE` layers whose experts `convert_experts` rebuilt; the MoE forward runs
SGLang's CPU path (`moe_forward_native`) through our `run_moe_core` hook. The scheduler's copies of
the pool size need a real scheduler: tests/test_server_offload.py checks those.
"""

import socket

import pytest
import torch

from vamp_sglang.integration.memory import expert_memory as em
from vamp_sglang.integration.memory import expert_memory_hooks as hooks
from vamp_sglang.integration.memory import kv_pool
from vamp_sglang.integration.staging import moe_staging
from vamp_sglang.memory.backend import LiveCounts
from vamp_sglang.memory.host_backend import HostPageBackend
from vamp_sglang.memory.kv_buffers import KVShrinkError
from vamp_sglang.memory.region import bytes_checksum

GRAN = 64 << 10
E, H, I = 16, 64, 64  # w13 shard 32 KiB, w2 16 KiB: a group is 4 experts = 3 pages per layer
KV_HEADS, HEAD_DIM, LAYERS = 2, 64, 3  # a KV row is 512 B: 128 rows per page
POOL_TOKENS = 200
RATIO = 0.5  # bound: 2 of the 4 groups


@pytest.fixture(scope="module")
def sglang_moe():
    from sglang.srt.distributed.parallel_state import destroy_model_parallel
    from sglang.test.layer_ut_utils import init_single_process_dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # built anew for each module: a module before this one may have reset SGLang's runtime context, where
    # the groups and the EP rank MoE blocks read live (tests/test_radix_core.py publishes a tokenizer's)
    destroy_model_parallel()
    init_single_process_dist(master_port=port)
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    return FusedMoE, lambda original, hook: _wrap_fn(original, hook, HookType.AROUND)


def make_layers(FusedMoE, seed=0, fused_shared_experts=0):
    g = torch.Generator().manual_seed(seed)
    layers = torch.nn.ModuleList(
        FusedMoE(num_experts=E + fused_shared_experts, hidden_size=H, intermediate_size=I, layer_id=i,
                 top_k=2 + fused_shared_experts, num_fused_shared_experts=fused_shared_experts,
                 params_dtype=torch.float32) for i in range(LAYERS))
    for layer in layers:
        layer.w13_weight.data.copy_(torch.randn(layer.w13_weight.shape, generator=g) * 0.1)
        layer.w2_weight.data.copy_(torch.randn(layer.w2_weight.shape, generator=g) * 0.1)
    return layers


@pytest.fixture
def fused_shared_experts():
    """FusedMoE rows after the routed experts that hold a fused shared expert (Qwen3-Next on CUDA)."""
    return 0


@pytest.fixture
def vamp(sglang_moe, monkeypatch, fused_shared_experts):
    """Paged experts + a real pool and allocator built through our hooks; yields a namespace."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    FusedMoE_, around = sglang_moe
    backend = HostPageBackend("cpu", granularity_bytes=GRAN)
    layers = make_layers(FusedMoE_, fused_shared_experts=fused_shared_experts)
    originals = [(l.w13_weight.detach().clone(), l.w2_weight.detach().clone()) for l in layers]
    experts = moe_staging.convert_experts(layers, backend, RATIO)
    monkeypatch.setattr(hooks, "_process", hooks._Process(backend, experts))
    monkeypatch.setattr(MHATokenToKVPool, "_create_buffers_normal",
                        around(MHATokenToKVPool._create_buffers_normal, hooks._around_create_buffers_normal))
    monkeypatch.setattr(FusedMoE, "run_moe_core", around(FusedMoE.run_moe_core, hooks._around_run_moe_core))

    def build(page_size=1, publish=dict, states=None, tree_cache=None):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        size = POOL_TOKENS - POOL_TOKENS % page_size
        pool = MHATokenToKVPool(size, page_size=page_size, dtype=torch.float32, head_num=KV_HEADS,
                                head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        if page_size == 1:
            alloc = TokenToKVPoolAllocator(size, dtype=torch.float32, device="cpu", kvcache=pool, need_sort=False)
        else:
            alloc = PagedTokenToKVPoolAllocator(size, page_size=page_size, dtype=torch.float32, device="cpu",
                                                kvcache=pool, need_sort=False)
        memory = em.ExpertMemory(experts, hooks._process.pool, alloc, publish=publish, quiesce=lambda: None,
                                 states=states, tree_cache=tree_cache)
        ns.memory = memory
        return pool, alloc, memory

    class NS:
        pass

    ns = NS()
    ns.memory = None
    ns.backend, ns.layers, ns.originals, ns.experts, ns.build = backend, layers, originals, experts, build
    yield ns
    if ns.memory is not None:
        ns.memory.repartitioner.close()
    if hooks._process.pool is not None:
        hooks._process.pool.kv.close()
    if hooks._process.states is not None:
        hooks._process.states.buffers.close()
    experts.close()
    assert backend.live_counts() == LiveCounts(0, 0, 0), "a page was lost or is held twice"
    backend.close()


def tokens_per_group():
    pages_per_buffer = (3 * (LAYERS - 1)) // (2 * LAYERS)  # a group frees 3 pages in each eligible layer
    return pages_per_buffer * GRAN // (KV_HEADS * HEAD_DIM * 4)


def kv_sums(pool, ids):
    return [bytes_checksum(b[ids]) for b in [*pool.k_buffer, *pool.v_buffer]]


def fill_kv(pool, ids, seed):
    g = torch.Generator().manual_seed(seed)
    for b in [*pool.k_buffer, *pool.v_buffer]:
        b[ids] = torch.randn((len(ids), KV_HEADS, HEAD_DIM), generator=g)


@pytest.mark.parametrize("page_size", [1, 16])
def test_offload_grows_sglang_pool_in_place(vamp, page_size):
    pool, alloc, memory = vamp.build(page_size)
    base = pool.size
    assert pool.k_buffer[0].shape == (base + page_size, KV_HEADS, HEAD_DIM)
    ptrs = [b.data_ptr() for b in [*pool.k_buffer, *pool.v_buffer]]
    used = alloc.alloc(base // 2)
    fill_kv(pool, used, seed=1)
    before = kv_sums(pool, used)
    assert memory.headroom_groups() == 2 and memory.tokens_for(1) == tokens_per_group()

    memory.offload(1, tokens_per_group())

    grown = base + tokens_per_group()
    assert (alloc.size, pool.size, memory.offloaded_groups) == (grown, grown, 1)
    assert alloc.available_size() == grown - base // 2
    assert [b.data_ptr() for b in [*pool.k_buffer, *pool.v_buffer]] == ptrs
    assert all(b.shape[0] == grown + page_size for b in [*pool.k_buffer, *pool.v_buffer])
    assert kv_sums(pool, used) == before, "KV rows in use changed"
    new = alloc.alloc(alloc.available_size())
    assert len(torch.unique(torch.cat((used, new)))) == grown and int(new.max()) == grown + page_size - 1
    assert all(bool((b[base + page_size:] == 0).all()) for b in pool.k_buffer), "new rows hold expert bytes"
    fill_kv(pool, new, seed=2)  # the new rows are real, writable memory
    assert kv_sums(pool, used) == before


def test_offload_publishes_fewer_tokens_than_offered_and_restores(vamp):
    pool, alloc, memory = vamp.build()
    memory.offload(1, 100)
    assert alloc.size == POOL_TOKENS + 100 and memory.tokens_for(0) == tokens_per_group() - 100
    assert memory.restorable_groups() == 1
    assert memory.restore(1) == 100
    assert (alloc.size, pool.size, memory.offloaded_groups, alloc.available_size()) == (
        POOL_TOKENS, POOL_TOKENS, 0, POOL_TOKENS)
    with pytest.raises(ValueError, match="tokens must be"):
        memory.offload(1, tokens_per_group() + 1)
    with pytest.raises(ValueError, match="n_groups"):
        memory.tokens_for(3)


def test_restore_only_over_free_tail_ids_and_experts_come_back_intact(vamp):
    pool, alloc, memory = vamp.build()
    memory.offload(2, memory.tokens_for(2))
    size = alloc.size
    everything = alloc.alloc(size)
    fill_kv(pool, everything, seed=3)
    sums = kv_sums(pool, everything)
    assert memory.restorable_groups() == 0
    with pytest.raises(KVShrinkError):
        memory.restore(1)
    assert (alloc.size, memory.offloaded_groups, alloc.available_size()) == (size, 2, 0)
    assert kv_sums(pool, everything) == sums, "a refused restore touched KV rows"

    keep = everything[everything <= POOL_TOKENS + tokens_per_group()]
    alloc.free(everything[everything > POOL_TOKENS + tokens_per_group()])
    kept = kv_sums(pool, keep)
    assert memory.restorable_groups() == 1
    assert memory.restore(1) == tokens_per_group()
    assert kv_sums(pool, keep) == kept and alloc.size == POOL_TOKENS + tokens_per_group()
    alloc.free(keep)
    memory.restore(1)
    for layer, (w13, w2) in zip(vamp.layers, vamp.originals):
        assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)


def test_a_failed_publish_rolls_back_pool_allocator_and_experts(vamp):
    calls = []

    def publish():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the scheduler refused the new size")
        return {}

    pool, alloc, memory = vamp.build(publish=publish)
    used = alloc.alloc(50)
    fill_kv(pool, used, seed=4)
    sums, free = kv_sums(pool, used), alloc.free_pages.clone()
    weights = [(bytes_checksum(l.w13_weight[:8]), bytes_checksum(l.w2_weight[:8])) for l in vamp.layers]
    with pytest.raises(RuntimeError, match="injected"):
        memory.offload(1, tokens_per_group())
    assert (alloc.size, pool.size, memory.offloaded_groups) == (POOL_TOKENS, POOL_TOKENS, 0)
    assert torch.equal(torch.sort(alloc.free_pages).values, torch.sort(free).values)
    assert pool.k_buffer[0].shape[0] == POOL_TOKENS + 1 and kv_sums(pool, used) == sums
    assert [(bytes_checksum(l.w13_weight[:8]), bytes_checksum(l.w2_weight[:8])) for l in vamp.layers] == weights
    memory.offload(1, tokens_per_group())  # the next attempt goes through
    assert alloc.size == POOL_TOKENS + tokens_per_group()


def moe_outputs(layers, experts, x, topk):
    """SGLang's MoE forward of every layer on the same input, as one forward pass sees them."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    experts.engine.begin_forward()
    outs = []
    for layer, (w, ids, logits) in zip(layers, topk):
        outs.append(layer(x, StandardTopKOutput(w, ids, logits)))
    return outs


def router_outputs(g, tokens):
    """Per layer, top-2 (weights, int32 ids, logits) of random router logits for `tokens` tokens."""
    topk = []
    for _ in range(LAYERS):
        logits = torch.randn(tokens, E, generator=g)
        w, ids = torch.topk(torch.softmax(logits, -1), 2)
        topk.append((w, ids.to(torch.int32), logits))
    return topk


def test_moe_outputs_exact_at_every_offload_level(vamp):
    _, _, memory = vamp.build()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, H, generator=g)
    topk = router_outputs(g, 64)
    ids_used = torch.unique(torch.cat([t[1].flatten() for t in topk]))
    assert int(ids_used.max()) == E - 1, "the routing must reach the offloaded (high-index) experts"
    reference = moe_outputs(vamp.layers, vamp.experts, x, topk)
    assert moe_staging.staging_breaks(vamp.experts) == LAYERS - 1  # graphs stay on: one break per layer
    for groups in (1, 1, -1, -1):  # 1 group, the bound (2), back to 1, none
        if groups > 0:
            memory.offload(groups, memory.tokens_for(groups))
        else:
            memory.restore(-groups)
        for store in vamp.experts.stores:  # poison the staging slots: only a staging copy fixes them
            for dst, _ in store.staging_pairs():
                dst.fill_(float("nan"))
        out = moe_outputs(vamp.layers, vamp.experts, x, topk)
        assert all(torch.equal(a, b) for a, b in zip(out, reference)), f"{memory.offloaded_groups} groups"
    assert vamp.experts.engine.stats().bytes_staged > 0


def test_offloaded_experts_are_read_from_the_staging_slot(vamp):
    _, _, memory = vamp.build()
    layer, store = vamp.layers[1], vamp.experts.stores[0]
    memory.offload(1, memory.tokens_for(1))
    b = store.boundary_expert
    store.w13[b:].fill_(0.0)  # writes through the alias into the staging slot
    assert bool((vamp.experts.stores[0].w13[b:] == 0).all())
    assert torch.equal(layer.w13_weight[:b], vamp.originals[1][0][:b]), "resident experts moved"
    vamp.experts.engine.begin_forward()
    vamp.experts.engine.before_moe(layer.layer_id)
    assert torch.equal(layer.w13_weight[b:], vamp.originals[1][0][b:]), "staging did not refill the slot"


def test_hooks_pass_through_when_vamp_is_off(sglang_moe, monkeypatch):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    _, around = sglang_moe
    monkeypatch.setattr(hooks, "_process", None)
    monkeypatch.setattr(MHATokenToKVPool, "_create_buffers_normal",
                        around(MHATokenToKVPool._create_buffers_normal, hooks._around_create_buffers_normal))
    pool = MHATokenToKVPool(64, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=HEAD_DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    assert pool.k_buffer[0]._base is not None and pool.k_buffer[0]._base.shape[0] == 2  # SGLang's fused K/V
    assert hooks.current_memory() is None
    with pytest.raises(kv_pool.UnsupportedPoolError, match="v_head_dim"):
        odd = MHATokenToKVPool.__new__(MHATokenToKVPool)
        odd.kv_cache_layout, odd.head_dim, odd.v_head_dim, odd.enable_custom_mem_pool = "nhd", 64, 32, False
        kv_pool.check_pool(odd)


@pytest.mark.parametrize("policy", ["routed", "auto"])
def test_routed_staging_through_sglangs_moe_is_exact_and_reported(vamp, policy):
    """Issue 12 through the real hook and SGLang's CPU MoE kernel: the router's top-k ids reach the
    staging break, only routed offloaded rows are copied (NaN in every other staged row is never read),
    and /vamp/stats and the vamp:* series carry the per-mode figures."""
    from vamp_sglang.integration.metrics.prometheus import GAUGES, _lookup
    from vamp_sglang.memory.staging import StagingEngine

    _, _, memory = vamp.build()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, H, generator=g)
    topk = router_outputs(g, 4)
    reference = moe_outputs(vamp.layers, vamp.experts, x, topk)
    vamp.experts.engine.close()
    vamp.experts.engine = StagingEngine(vamp.experts.stores, staging=policy, top_k=2)
    memory.offload(2, memory.tokens_for(2))
    for _ in range(3):
        for store in vamp.experts.stores:
            for dst, _ in store.staging_pairs():
                dst.fill_(float("nan"))
        out = moe_outputs(vamp.layers, vamp.experts, x, topk)
        assert all(torch.equal(a, b) for a, b in zip(out, reference))
    stats = memory.stats()["staging"]
    assert stats["policy"] == policy and set(stats["modes"]) == {"whole", "routed", "host"}
    assert sum(mode["steps"] for mode in stats["modes"].values()) == stats["steps"]
    if policy == "routed":
        whole = 3 * sum(s.staged_bytes() for s in vamp.experts.stores)
        assert 0 < stats["bytes"] == stats["modes"]["routed"]["bytes"] < whole
    for name, _, path in GAUGES:
        if name.startswith("vamp:staging") or name == "vamp:staged_bytes_total":
            assert _lookup({"staging": stats}, path) is not None, name


def test_the_full_attention_pool_grows_under_its_hybrid_wrapper(vamp):
    """Our pool hook lays the wrapper's full-attention pool over growable buffers; an offload grows it,
    and the wrapper (which SGLang's allocator and model runner read) sees the new size."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    from tests.test_radix_hybrid import req_pool

    reqs = req_pool()
    wrapper = HybridLinearKVPool(size=POOL_TOKENS, dtype=torch.float32, page_size=1, head_num=KV_HEADS,
                                 head_dim=HEAD_DIM, full_attention_layer_ids=list(range(LAYERS)), device="cpu",
                                 mamba_pool=reqs.mamba_pool)
    alloc = TokenToKVPoolAllocator(POOL_TOKENS, dtype=torch.float32, device="cpu", kvcache=wrapper, need_sort=False)
    assert hooks._process.pool.pool is wrapper.full_kv_pool
    memory = em.ExpertMemory(vamp.experts, hooks._process.pool, alloc, publish=dict, quiesce=lambda: None)
    vamp.memory = memory
    memory.offload(1, tokens_per_group())
    grown = POOL_TOKENS + tokens_per_group()
    assert (alloc.size, wrapper.size, wrapper.full_kv_pool.size) == (grown, grown, grown)
    assert wrapper.get_key_buffer(LAYERS - 1).shape[0] == grown + 1
    memory.restore(1)
    assert (alloc.size, wrapper.size) == (POOL_TOKENS, POOL_TOKENS)
