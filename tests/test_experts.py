"""ExpertStore on real host pages: rebuilt tensors, fixed addresses, aliasing onto staging, exact restore.

Also holds the small helpers the staging and repartition tests share (a plain-torch MoE forward like
SGLang's `moe_forward_native`, random weights, a host backend with 64 KiB pages)."""

import pytest
import torch

from vamp_sglang.memory.backend_choice import select_backend
from vamp_sglang.memory.experts import ExpertStore
from vamp_sglang.memory.layout import ExpertLayout, LayoutError
from vamp_sglang.memory.staging_slots import StagingBuffers, build_expert_stores

GRAN = 64 * 1024


def host_backend(granularity_bytes: int = GRAN):
    return select_backend("host", "cpu", granularity_bytes=granularity_bytes)


def make_weights(layer_ids, experts, hidden, inter, seed=0):
    """{layer: (w13 [E, 2I, H], w2 [E, H, I], router [E, H])} in float32."""
    gen = torch.Generator().manual_seed(seed)
    return {lid: (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5,
                  torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5,
                  torch.randn(experts, hidden, generator=gen)) for lid in layer_ids}


def make_layout(weights, ratio, granularity_bytes=GRAN, staging_capacity_shards=None):
    w13, w2, _ = next(iter(weights.values()))
    experts = w13.shape[0]
    return ExpertLayout.compute(sorted(weights), experts, w13[0].numel() * 4, w2[0].numel() * 4,
                                granularity_bytes, ratio,
                                experts if staging_capacity_shards is None else staging_capacity_shards)


@pytest.fixture
def backend():
    be = host_backend()
    yield be
    be.close()


def test_rebuilt_tensors_equal_originals_and_host_copy_holds_the_tail(backend):
    weights = make_weights([0, 1, 2], 24, 128, 64)  # w13 64 KiB, w2 32 KiB: g = 2
    layout = make_layout(weights, 0.5)
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    for store in stores:
        w13, w2, _ = weights[store.layer_id]
        assert torch.equal(store.w13, w13) and torch.equal(store.w2, w2)
        assert store.w13.data_ptr() != w13.data_ptr()  # really moved onto paged memory
        assert torch.equal(store.host_w13, w13[24 - layout.offloadable_experts:])
        assert torch.equal(store.host_w2, w2[24 - layout.offloadable_experts:])
    assert layout.offloadable_experts == 12
    for store in stores:
        store.close()
    staging.close()


def test_offload_aliases_staging_pages_and_restore_is_exact(backend):
    weights = make_weights([0, 1, 2], 24, 128, 64)
    layout = make_layout(weights, 0.5)
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    store = stores[0]
    w13, w2, _ = weights[store.layer_id]
    ptrs = (store.w13.data_ptr(), store.w2.data_ptr())
    before = store.expert_checksums(0, 24)
    freed = store.offload_tail_pages(3)  # 6 experts; a group is 2 w13 pages + 1 w2 page
    assert len(freed) == 3 * layout.pages_per_group_per_layer
    assert store.boundary_expert == 18
    assert store.expert_checksums(0, 18) == before[:18]
    # The offloaded range now reads the staging slot: writing through the slot shows in the tensor.
    for dst, src in store.staging_pairs():
        dst.fill_(7.0)
    assert bool((store.w13[18:] == 7.0).all()) and bool((store.w2[18:] == 7.0).all())
    slot13, _slot2 = staging.alias_pages(store.layer_id)
    assert slot13 == staging.slots[0].w13_pages  # eligible index 0 reads slot 0
    for dst, src in store.staging_pairs():
        dst.copy_(src)
    assert torch.equal(store.w13, w13) and torch.equal(store.w2, w2)
    # Give the pages back after scribbling on them (as the KV pool would): the host copy restores them.
    for handle in freed:
        scratch = backend.reserve(GRAN)
        backend.map(scratch, handle)
        backend.tensor(scratch, GRAN, torch.uint8, (GRAN,)).fill_(0xAB)
        backend.unmap(scratch, GRAN)
        backend.free_reservation(scratch, GRAN)
    store.restore_tail(freed[:len(freed) // 3 * 2], 2)
    store.restore_tail(None, 1)  # fresh pages
    assert store.offloaded_groups == 0
    assert store.expert_checksums(0, 24) == before
    assert (store.w13.data_ptr(), store.w2.data_ptr()) == ptrs
    for handle in freed[len(freed) // 3 * 2:]:
        backend.release(handle)
    for s in stores:
        s.close()
    staging.close()
    assert backend.live_counts().handles == 0


def test_groups_from_the_top_leave_a_resident_pad(backend):
    """E = 25 with g = 2: 12 groups from the top; the tensor starts after a pad so its end is aligned."""
    weights = make_weights([0, 1], 25, 128, 64)
    layout = make_layout(weights, 0.5)
    assert (layout.groups_per_layer, layout.always_resident_experts) == (12, 1)
    staging, (store,) = build_expert_stores(backend, layout, {1: weights[1][:2]})
    assert (store.w13.data_ptr() + store.w13.numel() * 4) % GRAN == 0
    assert torch.equal(store.w13, weights[1][0])
    store.offload_tail_pages(layout.bound_groups)
    assert store.boundary_expert == 25 - 2 * layout.bound_groups
    store.restore_tail(None, layout.bound_groups)
    assert torch.equal(store.w13, weights[1][0]) and torch.equal(store.w2, weights[1][1])
    store.close()
    staging.close()


def test_bounds_and_shape_errors(backend):
    weights = make_weights([0, 1], 24, 128, 64)
    layout = make_layout(weights, 0.25)  # bound 3 groups
    staging, (store,) = build_expert_stores(backend, layout, {1: weights[1][:2]})
    with pytest.raises(LayoutError, match="offloaded_groups"):
        store.offload_tail_pages(4)
    with pytest.raises(LayoutError, match="offloaded_groups"):
        store.restore_tail(None, 1)
    assert store.offloaded_groups == 0 and torch.equal(store.w13, weights[1][0])
    with pytest.raises(LayoutError, match="not an offload-eligible"):
        ExpertStore(backend, layout, 0, *weights[0][:2], *staging.alias_pages(1))
    with pytest.raises(LayoutError, match="w2 shape"):
        ExpertStore(backend, layout, 1, weights[1][0], weights[1][1][:5], *staging.alias_pages(1))
    store.close()
    staging.close()


def test_no_staging_pages_when_nothing_may_leave(backend):
    weights = make_weights([0, 1], 8, 128, 64)
    layout = make_layout(weights, 0.1)  # 0.8 experts < g
    staging = StagingBuffers(backend, layout)
    assert layout.bound_groups == 0 and staging.nbytes == 0 and staging.alias_pages(1) == ((), ())
    store = ExpertStore(backend, layout, 1, *weights[1][:2])
    assert store.host_w13.shape[0] == 0 and torch.equal(store.w13, weights[1][0])
    store.close()
