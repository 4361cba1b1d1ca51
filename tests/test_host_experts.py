"""`--vamp-staging host` without SGLang: the slots routed to offloaded rows are masked for the layer's kernel
and computed from the host copies, and the two halves add up to the whole layer (issue 49)."""

from typing import NamedTuple

import pytest
import torch
from test_experts import host_backend, make_layout, make_weights
from test_residency import moe_with_ids, skewed_routes

from vamp_sglang.integration.staging.host_experts import HostExpertStats, run_moe_core_host
from vamp_sglang.memory.staging_slots import build_expert_stores

EXPERTS, HIDDEN, INTER, TOKENS = 24, 128, 64, 32


class TopK(NamedTuple):  # the fields of SGLang's StandardTopKOutput the split reads
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


class Dispatch(NamedTuple):  # ... and of its StandardDispatchOutput
    hidden_states: torch.Tensor
    topk_output: TopK


class Combine(NamedTuple):
    hidden_states: torch.Tensor


@pytest.fixture
def layer():
    backend = host_backend()
    weights = make_weights([0, 1], EXPERTS, HIDDEN, INTER, seed=6)
    staging, stores = build_expert_stores(backend, make_layout(weights, 0.5), {1: weights[1][:2]})
    yield weights[1], stores[0]
    stores[0].close()
    staging.close()
    backend.close()


def test_masked_kernel_plus_host_half_is_the_whole_layer(layer):
    (w13, w2, router), store = layer
    for handle in store.offload_tail_pages(store.layout.bound_groups):
        store.backend.release(handle)
    store.w13[store.boundary_expert:store.routed_experts].fill_(float("nan"))  # the slot's stale bytes
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    gates, ids = skewed_routes(router, x)
    seen = []

    def kernel(_layer, dispatch_output):  # the device's kernel over the paged tensors
        topk = dispatch_output.topk_output
        seen.append(topk.topk_ids.clone())
        skipped = topk.topk_ids < 0  # as CPU mode's native MoE: a -1 slot adds nothing
        return Combine(moe_with_ids(dispatch_output.hidden_states, topk.topk_weights.masked_fill(skipped, 0),
                                    topk.topk_ids.clamp_min(0), store.w13, store.w2))

    stats = HostExpertStats()
    out = run_moe_core_host(kernel, None, store, stats, True, Dispatch(x, TopK(gates, ids)))
    cold = int(((ids >= store.boundary_expert) & (ids < store.routed_experts)).sum())
    assert cold > 0 and stats.as_dict() == {"pairs": cold, "steps": 1, "pairs_per_step": float(cold)}
    assert int(seen[0].max()) < store.boundary_expert and int((seen[0] < 0).sum()) == cold  # no offloaded row
    assert torch.allclose(out.hidden_states, moe_with_ids(x, gates, ids, w13, w2), atol=1e-6, rtol=0)


def test_nothing_offloaded_runs_the_kernel_alone(layer):
    (_w13, _w2, router), store = layer
    x = torch.randn(4, HIDDEN)
    calls = []
    stats = HostExpertStats()
    run_moe_core_host(lambda _l, dispatch_output: calls.append(dispatch_output), None, store, stats, False,
                      Dispatch(x, TopK(*skewed_routes(router, x))))
    assert len(calls) == 1 and stats.pairs == 0 and stats.as_dict()["pairs_per_step"] == 0.0
