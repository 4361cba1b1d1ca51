"""VAMP grows SGLang's MLA latent pool in place (DeepSeek): the real `MLATokenToKVPool`, built through our
`MLATokenToKVPool._create_buffers` hook, served by SGLang's allocator and grown and shrunk by `ExpertMemory`
with pages of three real `FusedMoE` layers (tests/test_integration_memory.py's set-up).

MLA keeps one buffer per layer, `[rows, 1, kv_lora_rank + qk_rope_head_dim]`: a group's freed pages split
over `layers` buffers, not `2 * layers`, and a token costs one latent row per layer, so a group buys
`pages * granularity / (80 * 4)` tokens here against MHA's 128 for the same pages. The pool's `data_ptrs`
table (built once from the buffers, memory_pool.py MLATokenToKVPool.__init__) stays valid because the
buffers grow at fixed addresses. A restore's compaction moves cached latent rows below the new size.
"""

from array import array

import pytest
import torch

from tests.test_integration_memory import GRAN, LAYERS, POOL_TOKENS, make_layers, sglang_moe  # noqa: F401
from vamp_sglang.integration.memory import compaction, kv_pool
from vamp_sglang.integration.memory import expert_memory as em
from vamp_sglang.integration.memory import expert_memory_hooks as hooks
from vamp_sglang.integration.staging import moe_staging
from vamp_sglang.memory.backend import LiveCounts
from vamp_sglang.memory.host_backend import HostPageBackend

KV_LORA_RANK, ROPE_DIM = 64, 16
ROW = KV_LORA_RANK + ROPE_DIM  # 320 B a row in float32: 204 rows per 64 KiB page
RATIO = 0.5


def rows(pages):
    return pages * GRAN // (ROW * 4)


def tokens_for(groups):
    """A group frees 3 pages in each of 2 eligible layers: 2 more pages for each of the 3 latent buffers,
    which start with the one page the 201 rows need (204 rows)."""
    pages_per_group = (3 * (LAYERS - 1)) // LAYERS
    return rows(1 + groups * pages_per_group) - rows(1)


def tokens_per_group():
    return tokens_for(1)


@pytest.fixture
def mla(sglang_moe, monkeypatch):  # noqa: F811
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    FusedMoE_, around = sglang_moe
    backend = HostPageBackend("cpu", granularity_bytes=GRAN)
    layers = make_layers(FusedMoE_)
    experts = moe_staging.convert_experts(layers, backend, RATIO)
    monkeypatch.setattr(hooks, "_process", hooks._Process(backend, experts))
    monkeypatch.setattr(MLATokenToKVPool, "_create_buffers",
                        around(MLATokenToKVPool._create_buffers, hooks._around_create_buffers_normal))
    pool = MLATokenToKVPool(POOL_TOKENS, page_size=1, dtype=torch.float32, kv_lora_rank=KV_LORA_RANK,
                            qk_rope_head_dim=ROPE_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(POOL_TOKENS, dtype=torch.float32, device="cpu", kvcache=pool, need_sort=False)
    memory = em.ExpertMemory(experts, hooks._process.pool, alloc, publish=dict, quiesce=lambda: None)
    yield pool, alloc, memory
    memory.repartitioner.close()
    hooks._process.pool.kv.close()
    experts.close()
    assert backend.live_counts() == LiveCounts(0, 0, 0), "a page was lost or is held twice"
    backend.close()


def fill(pool, ids, seed):
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):  # through SGLang's own write path (torch_native's set_kv_buffer)
        pool.set_kv_buffer(None, ids, torch.randn((len(ids), 1, ROW), generator=g), None, layer_id_override=layer)


def latents(pool, ids):
    return [pool.get_key_buffer(layer)[ids].clone() for layer in range(LAYERS)]


def test_the_latent_pool_is_laid_over_growable_buffers(mla):
    pool, _, memory = mla
    assert pool.kv_buffer[0].shape == (POOL_TOKENS + 1, 1, ROW)
    assert memory.pool.kv.n_buffers == LAYERS  # one buffer per layer, not two
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]
    assert memory.tokens_for(1) == tokens_per_group() and memory.tokens_for(2) == tokens_for(2)


def test_offload_grows_the_latent_pool_in_place_and_restore_gives_it_back(mla):
    pool, alloc, memory = mla
    used = alloc.alloc(POOL_TOKENS // 2)
    fill(pool, used, seed=1)
    before, ptrs = latents(pool, used), pool.data_ptrs.clone()

    memory.offload(1, tokens_per_group())

    grown = POOL_TOKENS + tokens_per_group()
    assert (alloc.size, pool.size, memory.offloaded_groups) == (grown, grown, 1)
    assert all(b.shape == (grown + 1, 1, ROW) for b in pool.kv_buffer)
    assert torch.equal(pool.data_ptrs, ptrs) and pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]
    assert all(torch.equal(a, b) for a, b in zip(latents(pool, used), before, strict=True))
    assert all(bool((b[POOL_TOKENS + 1:] == 0).all()) for b in pool.kv_buffer), "new rows hold expert bytes"
    new = alloc.alloc(alloc.available_size())
    assert int(new.max()) == grown
    fill(pool, new, seed=2)  # SGLang writes the new rows (its bounds check reads the grown size)
    assert all(torch.equal(a, b) for a, b in zip(latents(pool, used), before, strict=True))

    alloc.free(new)
    assert memory.restorable_groups() == 1 and memory.restore(1) == tokens_per_group()
    assert (alloc.size, pool.size) == (POOL_TOKENS, POOL_TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(latents(pool, used), before, strict=True))


def test_compaction_moves_cached_latent_rows_below_the_smaller_pool(mla):
    """Restore's compaction (integration/memory/compaction.py) on an MLA pool: the cached rows above the kept size
    move with their latent bytes, the tree points at them, and the prefix still matches."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from vamp_sglang.integration.cache import radix_backend, radix_tree

    radix_backend.install()
    pool, alloc, memory = mla
    memory.offload(1, tokens_per_group())
    params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(4, 256, "cpu", False),
                             token_to_kv_pool_allocator=alloc, page_size=1, tree_components=(ComponentType.FULL,),
                             eviction_policy="vamp", tree_core_backend=radix_backend.NAME)
    cache = radix_tree.VampUnifiedRadixCache(params)
    everything = alloc.alloc(alloc.available_size()).sort().values
    alloc.free(everything[:-6])  # a busy past: one prefix cached in the pool's top rows
    top = everything[-6:]
    fill(pool, top, seed=3)
    moved_bytes = latents(pool, top)
    tokens = [7, 8, 9, 10, 11, 12]
    cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=top.clone()))

    assert compaction.tail_is_movable(cache, alloc, POOL_TOKENS)
    assert compaction.compact_tail(cache, alloc, memory.pool.pool, POOL_TOKENS) == 6
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [*tokens, 1]))))
    rows = cache.path_device_indices(match.last_device_node)
    assert match.device_prefix_len == 6 and len(rows) == 6 and int(rows.max()) <= POOL_TOKENS
    assert all(torch.equal(a, b) for a, b in zip(latents(pool, rows), moved_bytes, strict=True))
    assert memory.restorable_groups() == 1 and memory.restore(1) == tokens_per_group()


def test_an_mla_subclass_vamp_cannot_grow_is_refused_by_name(mla):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPoolFP4

    pool, _, _ = mla
    fp4 = object.__new__(MLATokenToKVPoolFP4)
    fp4.__dict__.update(pool.__dict__)
    with pytest.raises(kv_pool.UnsupportedPoolError, match="MLATokenToKVPoolFP4"):
        kv_pool.check_pool(fp4)
    pool.use_dsa = True
    with pytest.raises(kv_pool.UnsupportedPoolError, match="DSA indexer"):
        kv_pool.check_pool(pool)


def test_an_mla_backend_sglang_picked_itself_that_bakes_the_page_count_is_refused_at_start(mla, monkeypatch):
    """SGLang gives DeepSeek-V3 trtllm_mla on Blackwell with no attention flag (model_overrides/deepseek_v2.py),
    which the launcher cannot see; the MLA pool's check reads the backends SGLang resolved."""
    pool, _, _ = mla
    resolved = {"--attention-backend": "trtllm_mla", "--decode-attention-backend": None,
                "--prefill-attention-backend": None}
    monkeypatch.setattr(kv_pool, "resolved_attention_backends", lambda: resolved)
    with pytest.raises(kv_pool.UnsupportedPoolError, match="--attention-backend trtllm_mla .*TMA descriptor"):
        kv_pool.check_pool(pool)
    resolved["--attention-backend"] = "fa3"
    kv_pool.check_pool(pool)  # reads the pool through pointers and strides: served


def test_the_resolved_backends_are_read_from_fields_sglangs_exec_namespace_has():
    from sglang.srt.arg_groups.fields.exec_ import ExecKernel

    from vamp_sglang.refusals import attention

    assert set(kv_pool.resolved_attention_backends()) <= set(attention.BACKEND_FLAGS)  # {} where unpublished
    names = {flag.removeprefix("--").replace("-", "_") for flag in attention.BACKEND_FLAGS}
    assert names <= set(ExecKernel.__struct_fields__)
