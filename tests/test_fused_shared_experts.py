"""Fused shared experts never leave (issue 19 item 6).

Where SGLang fuses a model's shared expert into the MoE kernel (Qwen3-Next on CUDA), FusedMoE stores it
as its last local expert(s), `num_fused_shared_experts` rows after the routed ones, and every token
selects it. Groups are taken from the top of the expert range, so the offloadable range must end below
those rows. Real FusedMoE layers built with a fused shared expert, converted by `convert_experts` on
real host pages, then offloaded to the bound; SGLang's CPU MoE runs through our `run_moe_core` hook.
"""

import pytest
import torch
from test_integration_memory import sglang_moe  # noqa: F401 (the fixture: dist groups for SGLang layers)

from vamp_sglang.integration.staging import moe_staging
from vamp_sglang.memory.host_backend import HostPageBackend

ROUTED, SHARED, HIDDEN, INTER, TOP_K, LAYERS = 16, 1, 64, 64, 2, 3
PAGE_BYTES = 64 << 10  # w13 shard 32 KiB, w2 16 KiB: a group is 4 experts
RATIO = 0.5  # bound: 2 of the 4 routed groups


@pytest.fixture
def fused(sglang_moe, monkeypatch):  # noqa: F811 (the fixture imported above)
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    g = torch.Generator().manual_seed(5)
    layers = torch.nn.ModuleList(
        FusedMoE(num_experts=ROUTED + SHARED, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=i,
                 top_k=TOP_K + SHARED, num_fused_shared_experts=SHARED, params_dtype=torch.float32)
        for i in range(LAYERS))
    for layer in layers:
        layer.w13_weight.data.copy_(torch.randn(layer.w13_weight.shape, generator=g) * 0.1)
        layer.w2_weight.data.copy_(torch.randn(layer.w2_weight.shape, generator=g) * 0.1)
    originals = [(layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()) for layer in layers]
    backend = HostPageBackend("cpu", granularity_bytes=PAGE_BYTES)
    experts = moe_staging.convert_experts(layers, backend, RATIO)
    original = FusedMoE.run_moe_core
    monkeypatch.setattr(FusedMoE, "run_moe_core", lambda layer, *a, **k: moe_staging.run_moe_core_staged(
        experts, original, layer, *a, **k))
    yield layers, originals, experts
    experts.close()


def offload_to_the_bound(experts):
    for store in experts.stores:
        for handle in store.offload_tail_pages(experts.layout.bound_groups):
            store.backend.release(handle)


def test_the_fused_shared_expert_stays_on_the_layers_own_pages(fused):
    layers, originals, experts = fused
    assert experts.layout.bound_groups == 2
    offload_to_the_bound(experts)
    for store in experts.stores:  # stale staging slots: whatever they alias reads NaN until staged
        for dst, _ in store.staging_pairs():
            dst.fill_(float("nan"))
    for layer, (w13, w2) in list(zip(layers, originals))[1:]:
        assert torch.equal(layer.w13_weight[ROUTED:], w13[ROUTED:]), "the fused shared expert was offloaded"
        assert torch.equal(layer.w2_weight[ROUTED:], w2[ROUTED:]), "the fused shared expert was offloaded"
    assert experts.stores[0].boundary_expert == ROUTED - 2 * 4


@pytest.mark.parametrize("staging", ["whole", "routed"])
def test_moe_outputs_with_a_fused_shared_expert_are_exact_at_the_bound(fused, staging):
    """Every token also selects the shared expert (id ROUTED): the output over offloaded, staged experts
    is bit for bit the unpaged one, in whole-region and routed-only steps."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    layers, _originals, experts = fused
    experts.engine.chooser.policy = staging
    g = torch.Generator().manual_seed(6)
    x = torch.randn(32, HIDDEN, generator=g)
    topk = []
    for _ in layers:
        logits = torch.randn(32, ROUTED, generator=g)
        w, ids = torch.topk(torch.softmax(logits, -1), TOP_K)
        shared = torch.full((32, SHARED), ROUTED, dtype=torch.int64)
        topk.append((torch.cat([w, torch.full((32, SHARED), 0.5)], -1), torch.cat([ids, shared], -1).to(torch.int32),
                     logits))

    def outputs():
        experts.engine.begin_forward(32)
        return [layer(x, StandardTopKOutput(*t)) for layer, t in zip(layers, topk)]

    reference = outputs()
    offload_to_the_bound(experts)
    for store in experts.stores:
        for dst, _ in store.staging_pairs():
            dst.fill_(float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(outputs(), reference))
    # a step with nothing offloaded stages nothing and counts as whole
    assert experts.engine.stats().by_mode[staging]["steps"] == {"whole": 2, "routed": 1}[staging]
