"""Speculative decoding's draft KV pools grow, roll back, shrink and compact with the target's pool.

SGLang's draft runner builds its own `MHATokenToKVPool` (one layer: an EAGLE/EAGLE3 head, or DeepSeek's MTP
layer in an `MLATokenToKVPool`) over the target's allocator: one token id is a row in both pools. Here the
real pools are built through our hooks (the draft one while a draft `ModelRunner.alloc_memory_pool` runs),
served by SGLang's allocator, and `ExpertMemory` grows them with pages of three real `FusedMoE` layers
(tests/test_integration_memory.py's set-up). The draft writes and reads its KV through SGLang's own pool API
(`set_kv_buffer`, `get_key_buffer`) at ids only the grown pool has: that fails when only the target grows.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.test_compaction_syncs import _use, random_tree
from tests.test_integration_memory import (  # noqa: F401 (fused_shared_experts, sglang_moe, vamp: fixtures)
    GRAN,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    POOL_TOKENS,
    fused_shared_experts,
    make_layers,
    sglang_moe,
    vamp,
)
from vamp_sglang.faults import Faults, InjectedFault
from vamp_sglang.integration.memory import compaction, draft_pools
from vamp_sglang.integration.memory import expert_memory as em
from vamp_sglang.integration.memory import expert_memory_hooks as hooks
from vamp_sglang.integration.memory.kv_pool import UnsupportedPoolError
from vamp_sglang.memory.region import bytes_checksum

DRAFT_LAYER_ID = LAYERS  # the draft's layer id follows the target's (DeepSeek's MTP layer is layer num_layers)


def _pool(layers, size=POOL_TOKENS, heads=KV_HEADS, start_layer=None):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size, page_size=1, dtype=torch.float32, head_num=heads, head_dim=HEAD_DIM,
                            layer_num=layers, device="cpu", enable_memory_saver=False, start_layer=start_layer)


def _as_draft_runner(build):
    """`build()` run inside a draft ModelRunner's `alloc_memory_pool`, through our hook; the runner keeps the
    pool as SGLang's does (model_runner.py:988, `self.token_to_kv_pool`)."""
    runner = SimpleNamespace(is_draft_worker=True)

    def alloc_memory_pool(runner):
        runner.token_to_kv_pool = build()
        return runner.token_to_kv_pool

    return hooks._around_alloc_memory_pool(alloc_memory_pool, runner)


@pytest.fixture
def spec(vamp, monkeypatch):  # noqa: F811
    """A target pool, one draft pool (an EAGLE head: one layer) and the ExpertMemory growing both."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    target = _pool(LAYERS)
    draft = _as_draft_runner(lambda: _pool(1, start_layer=DRAFT_LAYER_ID))
    alloc = TokenToKVPoolAllocator(POOL_TOKENS, dtype=torch.float32, device="cpu", kvcache=target, need_sort=False)
    memory = em.ExpertMemory(vamp.experts, hooks._process.pool, alloc, publish=dict, quiesce=lambda: None,
                             draft_pools=hooks._process.draft_pools)
    vamp.memory = memory
    yield SimpleNamespace(target=target, draft=draft, alloc=alloc, memory=memory)
    for grown in hooks._process.draft_pools:
        grown.kv.close()


def _draft_write(draft, ids, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((len(ids), KV_HEADS, HEAD_DIM), generator=g)
    v = torch.randn((len(ids), KV_HEADS, HEAD_DIM), generator=g)
    layer = SimpleNamespace(layer_id=DRAFT_LAYER_ID)
    draft.set_kv_buffer(layer, ids, k, v)
    return k, v


def _draft_read(draft, ids):
    return draft.get_key_buffer(DRAFT_LAYER_ID)[ids], draft.get_value_buffer(DRAFT_LAYER_ID)[ids]


def test_the_draft_reads_what_it_wrote_in_rows_only_the_grown_pool_has(spec):
    memory = spec.memory
    tokens = memory.tokens_for(2)  # the bound: one group's 6 pages do not split over the 8 buffers
    memory.offload(2, tokens)
    grown = POOL_TOKENS + tokens
    assert tokens > 0
    assert (spec.alloc.size, spec.target.size, spec.draft.size) == (grown, grown, grown)
    ids = spec.alloc.alloc(grown)  # every id, those past the start size included
    assert int(ids.max()) == grown
    new = ids[ids > POOL_TOKENS]
    k, v = _draft_write(spec.draft, new, seed=1)
    read_k, read_v = _draft_read(spec.draft, new)
    assert torch.equal(read_k, k) and torch.equal(read_v, v)
    rows = memory.pool.kv.row_capacity
    assert memory.stats()["draft_pools"] == [{"tokens": grown, "layers": 1, "buffer_rows": rows}]
    assert rows >= grown + 1 == spec.draft.k_buffer[0].shape[0]


def test_a_group_buys_fewer_tokens_when_the_draft_layer_shares_its_pages(vamp):  # noqa: F811
    """Bytes per token include the draft layer: the same freed pages split over 2 * (3 + 1) buffers."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    target = _pool(LAYERS)
    alloc = TokenToKVPoolAllocator(POOL_TOKENS, dtype=torch.float32, device="cpu", kvcache=target, need_sort=False)
    alone = em.ExpertMemory(vamp.experts, hooks._process.pool, alloc, publish=dict, quiesce=lambda: None)
    without_draft = alone.tokens_for(2)
    _as_draft_runner(lambda: _pool(1))
    with_draft = em.ExpertMemory(vamp.experts, hooks._process.pool, alloc, publish=dict, quiesce=lambda: None,
                                 draft_pools=hooks._process.draft_pools).tokens_for(2)
    row_bytes = KV_HEADS * HEAD_DIM * 4
    pages = 2 * 3 * (LAYERS - 1)  # two groups free 3 pages in each of the 2 eligible layers
    assert without_draft == pages // (2 * LAYERS) * GRAN // row_bytes
    assert with_draft == pages // (2 * (LAYERS + 1)) * GRAN // row_bytes < without_draft
    hooks._process.draft_pools[0].kv.close()


def test_a_failed_publish_rolls_the_draft_pool_back_with_the_target(spec):
    """The publish step fails after SGLang saw the new size (VAMP_SGLANG_FAULT=publish:1): the transaction
    takes the draft pool back with the target's."""
    spec.memory.faults = Faults.parse("publish:1")
    used = spec.alloc.alloc(50)
    k, v = _draft_write(spec.draft, used, seed=2)
    with pytest.raises(InjectedFault):
        spec.memory.offload(2, spec.memory.tokens_for(2))
    assert (spec.alloc.size, spec.target.size, spec.draft.size) == (POOL_TOKENS,) * 3
    assert spec.draft.k_buffer[0].shape[0] == POOL_TOKENS + 1
    assert all(torch.equal(a, b) for a, b in zip(_draft_read(spec.draft, used), (k, v)))
    spec.memory.faults = Faults.parse("")
    spec.memory.offload(2, spec.memory.tokens_for(2))
    assert spec.draft.size == spec.alloc.size > POOL_TOKENS


def test_a_restore_shrinks_the_draft_pool_and_keeps_its_rows(spec):
    memory = spec.memory
    memory.offload(2, memory.tokens_for(2))
    used = spec.alloc.alloc(POOL_TOKENS)
    sums = [bytes_checksum(t) for t in _draft_write(spec.draft, used, seed=3)]
    assert memory.restorable_groups() == 2
    memory.restore(2)
    assert (spec.alloc.size, spec.draft.size, spec.draft.k_buffer[0].shape[0]) == (POOL_TOKENS, POOL_TOKENS,
                                                                                    POOL_TOKENS + 1)
    assert [bytes_checksum(t) for t in _draft_read(spec.draft, used)] == sums


def test_a_draft_with_another_kv_row_is_refused_naming_the_flag(vamp):  # noqa: F811
    _pool(LAYERS)
    with pytest.raises(UnsupportedPoolError, match="--vamp-max-offload-ratio 0"):
        _as_draft_runner(lambda: _pool(1, heads=2 * KV_HEADS))
    assert hooks._process.draft_pools == []


def test_a_draft_runner_left_with_a_pool_vamp_did_not_lay_is_refused(vamp):  # noqa: F811
    """A draft pool built past the hooked creators (another buffer path, or one made before the runner's
    alloc_memory_pool) keeps its start-up rows while the shared allocator hands out grown ids: refused."""
    _pool(LAYERS)
    unlaid = _pool(1)  # built outside a draft runner: SGLang's own buffers
    with pytest.raises(UnsupportedPoolError, match="draft.*--vamp-max-offload-ratio 0"):
        _as_draft_runner(lambda: unlaid)


def test_pools_built_outside_a_draft_runner_pass_through(vamp):  # noqa: F811
    _pool(LAYERS)
    other = _pool(1)  # a second pool no draft runner asked for keeps SGLang's own buffers
    assert hooks._process.draft_pools == [] and other.k_buffer[0].shape[0] == POOL_TOKENS + 1


def test_compaction_moves_the_draft_rows_with_the_target_rows(monkeypatch):
    cache, core, allocator, target = random_tree(5)
    _, _, _, draft = random_tree(5)
    for buffer in [*draft.k_buffer, *draft.v_buffer]:
        buffer.mul_(7)  # other values, same rows
    _use(monkeypatch, core)
    moved = compaction.compact_tail(cache, allocator, [target, draft], keep_tokens=200)
    assert moved > 0
    for t, d in zip([*target.k_buffer, *target.v_buffer], [*draft.k_buffer, *draft.v_buffer]):
        assert torch.equal(d, t * 7), "a draft row did not move with its target row"


def test_the_buffer_set_refuses_members_of_other_rows():
    a = SimpleNamespace(row_bytes=512, row_multiple=1, pages_per_buffer=2, backend=None, n_buffers=6)
    b = SimpleNamespace(row_bytes=1024, row_multiple=1, pages_per_buffer=2, backend=None, n_buffers=2)
    with pytest.raises(UnsupportedPoolError, match="draft KV pool of 1024 B rows"):
        draft_pools.KVBufferSet([a, b])
    assert draft_pools.KVBufferSet([a, a]).n_buffers == 12


def test_a_draft_moe_with_a_target_layer_id_stays_resident_and_unstaged(vamp, spec):  # noqa: F811
    """DeepSeek's MTP layer is a FusedMoE of its own (`is_draft`) that runs every draft step: VAMP never
    converts it (the draft runner's initialize is skipped), and staging keys layers by identity, so a draft
    layer whose layer id equals an eligible target layer's runs SGLang's MoE on its own weights, untouched,
    however many target groups are offloaded, and stages nothing."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    draft_layer = make_layers(FusedMoE, seed=9)[1]  # layer id 1, an eligible target layer's id
    assert vamp.experts.layout.eligible_index(draft_layer.layer_id) is not None
    weights = (draft_layer.w13_weight.detach().clone(), draft_layer.w2_weight.detach().clone())
    hooks._after_model_runner_initialize(None, SimpleNamespace(is_draft_worker=True, model=[draft_layer]))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, draft_layer.w2_weight.shape[1], generator=g)
    logits = torch.randn(16, draft_layer.w13_weight.shape[0], generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), 2)
    topk = StandardTopKOutput(w, ids.to(torch.int32), logits)
    reference = draft_layer(x, topk)
    spec.memory.offload(2, spec.memory.tokens_for(2))
    vamp.experts.engine.begin_forward()
    staged = vamp.experts.engine.stats().bytes_staged
    assert torch.equal(draft_layer(x, topk), reference)
    assert vamp.experts.engine.stats().bytes_staged == staged, "the draft layer staged target experts"
    assert torch.equal(draft_layer.w13_weight, weights[0]) and torch.equal(draft_layer.w2_weight, weights[1])


def test_every_draft_runner_pool_grows_multi_layer_eagle(vamp):  # noqa: F811
    """Multi-layer EAGLE builds one draft runner, and one pool, per step: each grows with the target's."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    target = _pool(LAYERS)
    drafts = [_as_draft_runner(lambda step=step: _pool(1, start_layer=step)) for step in range(2)]
    alloc = TokenToKVPoolAllocator(POOL_TOKENS, dtype=torch.float32, device="cpu", kvcache=target, need_sort=False)
    memory = em.ExpertMemory(vamp.experts, hooks._process.pool, alloc, publish=dict, quiesce=lambda: None,
                             draft_pools=hooks._process.draft_pools)
    vamp.memory = memory
    memory.offload(2, memory.tokens_for(2))
    assert [d.size for d in drafts] == [alloc.size] * 2 and alloc.size > POOL_TOKENS
    assert [s["tokens"] for s in memory.stats()["draft_pools"]] == [alloc.size] * 2
    memory.restore(2)
    assert [d.size for d in drafts] == [POOL_TOKENS] * 2
    for grown in hooks._process.draft_pools:
        grown.kv.close()
