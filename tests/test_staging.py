"""Double-buffered staging: MoE outputs over remapped + staged experts are bit-identical to the originals
at 0%, 10%, 25% and the maximum offload (paper IV-D, V-B), and staging is what makes them so."""

import pytest
import torch
from test_experts import host_backend, make_layout, make_weights

from eval.bench_memory import moe_forward
from vamp_sglang.memory.staging import StagingEngine, build_expert_stores

LAYERS, EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = [0, 1, 2, 3], 40, 128, 128, 4, 64  # g = 1


@pytest.fixture
def model():
    backend = host_backend()
    weights = make_weights(LAYERS, EXPERTS, HIDDEN, INTER, seed=1)
    layout = make_layout(weights, 0.5)
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    yield backend, weights, layout, stores
    for store in stores:
        store.close()
    staging.close()
    backend.close()


def forward(x, weights, stores, engine=None, used=None):
    """Residual stack of MoE layers over the stores' tensors; layers without a store (the first MoE
    layer, or all of them for the reference) read the original weights."""
    tensors = {lid: w[:2] for lid, w in weights.items()} | {s.layer_id: (s.w13, s.w2) for s in stores}
    if engine is not None:
        engine.begin_forward()
    for lid in LAYERS:
        if engine is not None:
            engine.before_moe(lid)
        if used is not None:
            used[lid] = set(torch.topk(x @ weights[lid][2].T, TOP_K).indices.flatten().tolist())
        x = x + moe_forward(x, weights[lid][2], *tensors[lid], TOP_K)
        if engine is not None:
            engine.after_moe(lid)
    return x


def offload(stores, groups):
    for store in stores:
        for handle in store.offload_tail_pages(groups):
            store.backend.release(handle)


@pytest.mark.parametrize("ratio", [0.0, 0.10, 0.25, "max"])
def test_moe_output_is_bit_identical_at_every_offload_level(model, ratio):
    _backend, weights, layout, stores = model
    groups = layout.bound_groups if ratio == "max" else layout.groups_for_ratio(ratio)
    assert groups == {0.0: 0, 0.10: 4, 0.25: 10, "max": 20}[ratio]
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    reference = forward(x, weights, [])  # original tensors only
    offload(stores, groups)
    engine = StagingEngine(stores, "async")
    used: dict[int, set[int]] = {}
    for _ in range(2):  # the second forward reuses slots the first one filled
        assert torch.equal(forward(x, weights, stores, engine, used), reference)
    boundary = layout.boundary_expert(groups)
    if groups:  # the batch really read staged experts in every eligible layer
        assert all(any(e >= boundary for e in used[lid]) for lid in layout.eligible_layer_ids)
        assert engine.stats().copies == 2 * len(stores)
    engine.close()


def test_without_staging_the_offloaded_range_reads_stale_slot_data(model):
    _backend, weights, layout, stores = model
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    reference = forward(x, weights, stores)
    offload(stores, layout.groups_for_ratio(0.25))
    engine = StagingEngine(stores, "async")
    assert torch.equal(forward(x, weights, stores, engine), reference)
    # Layers 1 and 3 share slot 0, so after a forward layer 1's offloaded experts read layer 3's bytes.
    assert not torch.equal(forward(x, weights, stores), reference)
    engine.close()


def test_sync_mode_matches_and_counters_add_up(model):
    _backend, weights, layout, stores = model
    groups = layout.groups_for_ratio(0.25)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    reference = forward(x, weights, stores)
    offload(stores, groups)
    sync = StagingEngine(stores, "sync")
    assert torch.equal(forward(x, weights, stores, sync), reference)
    per_layer_bytes = groups * (layout.w13_group_pages + layout.w2_group_pages) * layout.granularity_bytes
    stats = sync.stats()
    assert (stats.copies, stats.bytes_staged, stats.unprefetched) == (3, 3 * per_layer_bytes, 0)
    sync.close()
    lazy = StagingEngine(stores, "async")  # no begin_forward: the first MoE layer starts the first copy
    for lid in LAYERS:
        lazy.before_moe(lid)
    assert (lazy.stats().unprefetched, lazy.stats().copies) == (0, 3)
    lazy.before_moe(1)  # a layer nobody prefetched for copies on demand
    assert lazy.stats().unprefetched == 1
    assert lazy._executor.submit(torch.get_num_threads).result() == 1  # one intra-op thread in the worker
    lazy.close()


def test_drain_discards_prefetch_for_an_old_boundary(model):
    _backend, weights, _layout, stores = model
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))
    reference = forward(x, weights, stores)
    offload(stores, 2)
    engine = StagingEngine(stores, "async")
    engine.begin_forward()  # a prefetch for 2 groups is in flight
    engine.drain()
    offload(stores, 6)  # the boundary moves before the forward runs
    assert torch.equal(forward(x, weights, stores, engine), reference)
    engine.close()


def test_next_layers_copy_is_issued_before_the_current_moe_runs(model):
    """Figure 5: while layer N's MoE runs, layer N+1's copy is already in flight (into the other slot)."""
    _backend, _weights, _layout, stores = model
    offload(stores, 4)
    engine = StagingEngine(stores, "async")
    engine.begin_forward()
    assert engine.stats().copies == 1  # layer 1, before the resident first MoE layer runs
    issued = []
    for lid in LAYERS:
        engine.before_moe(lid)
        issued.append(engine.stats().copies)
        engine.after_moe(lid)
    assert issued == [1, 2, 3, 3]  # at layer 1's MoE, layer 2's copy exists; at layer 2's, layer 3's
    engine.close()
