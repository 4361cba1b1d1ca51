"""Routed-only staging on CUDA through SGLang's paged-experts gather (issue 12): bit-identical outputs,
the routed bytes read back from the device count, and the copy replayed inside a CUDA graph."""

import pytest
import torch

from vamp_sglang.memory.routed import routed_offloaded_runs
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores

pytestmark = pytest.mark.gpu
EXPERTS, HIDDEN, INTER, TOP_K, LAYERS = 64, 512, 256, 4, [0, 1, 2]


@pytest.fixture
def cuda_model():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none here)")
    from vamp_sglang.memory.backend_choice import select_backend
    from vamp_sglang.memory.layout import ExpertLayout

    backend = select_backend("cuda", torch.device("cuda", 0))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {lid: (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16),
                     torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16),
                     torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16))
               for lid in LAYERS}
    layout = ExpertLayout.compute(LAYERS, EXPERTS, 2 * INTER * HIDDEN * 2, HIDDEN * INTER * 2,
                                  backend.granularity_bytes, 0.5, EXPERTS)
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    for store in stores:
        for handle in store.offload_tail_pages(layout.bound_groups):
            backend.release(handle)
    yield weights, stores
    for store in stores:
        store.close()
    staging.close()
    backend.close()


def test_gather_copies_exactly_the_routed_offloaded_rows(cuda_model):
    from vamp_sglang.integration.staging.routed_gather import GatherCopier

    weights, stores = cuda_model
    copier = GatherCopier(stores)
    engine = StagingEngine(stores, "async", staging="routed", top_k=TOP_K, routed_copier=copier)
    store = stores[0]
    ids = torch.randint(0, EXPERTS, (8, TOP_K), device="cuda", dtype=torch.int32)
    for dst, _ in store.staging_pairs():
        dst.fill_(3.0)
    engine.begin_forward(8)
    engine.before_moe(store.layer_id, ids)
    torch.cuda.synchronize()
    runs = routed_offloaded_runs(ids.cpu(), store.boundary_expert, EXPERTS)
    w13 = weights[store.layer_id][0]
    for first, end in runs:
        assert torch.equal(store.w13[first:end], w13[first:end])
    engine.after_moe(store.layer_id)
    rows = sum(end - first for first, end in runs)
    assert engine.stats().by_mode["routed"]["bytes"] == rows * (store.w13[0].numel() + store.w2[0].numel()) * 2
    engine.close()


def test_gather_copy_replays_inside_a_cuda_graph(cuda_model):
    from vamp_sglang.integration.staging.routed_gather import GatherCopier

    weights, stores = cuda_model
    copier, store = GatherCopier(stores), stores[0]
    ids = torch.zeros(8, TOP_K, dtype=torch.int32, device="cuda")
    copier(store, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copier(store, ids)
    w13 = weights[store.layer_id][0]
    for seed in range(3):
        for dst, _ in store.staging_pairs():
            dst.fill_(3.0)
        ids.copy_(torch.randint(0, EXPERTS, (8, TOP_K), device="cuda", dtype=torch.int32,
                                generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        for first, end in routed_offloaded_runs(ids.cpu(), store.boundary_expert, EXPERTS):
            assert torch.equal(store.w13[first:end], w13[first:end])
