# ruff: noqa: F811  (tests take the imported `model` fixture as an argument)
"""Issue 48 defect 8: routed staging over SGLang's top-k formats that carry no expert ids.

FlashInfer TRT-LLM (the Blackwell FP8 default) routes from the router logits inside its kernel: SGLang
hands `run_moe_core` a BYPASSED top-k output, with no `topk_ids`. A routed step then had each eligible layer
copy its whole region at `before_moe`, unprefetched, while the chooser kept picking routed. Here the real
SGLang formats go through `run_moe_core_staged` over the real staging engine on host pages."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
from sglang.srt.layers.moe.topk import (
    BypassedTopKOutput,
    PackedTopKOutput,
    StandardTopKOutput,
    StandardTopKOutputPacked,
    TopKConfig,
    TritonKernelTopKOutput,
)
from test_staging import HIDDEN, LAYERS, TOP_K, model, offload  # noqa: F401 (model: test_staging's fixture)

from eval.bench_memory import moe_forward
from vamp_sglang.integration.staging import moe_staging
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_choice import ROUTED, WHOLE

TOKENS = 8


def _formats(x, logits):
    """Each top-k format SGLang 0.5.23 hands a MoE kernel, for router `logits` over hidden states `x`."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K)
    weight_bits = weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    packed = (ids.to(torch.int32) << 16) | weight_bits
    return {
        "standard": StandardTopKOutput(weights, ids, logits),
        "standard_packed": StandardTopKOutputPacked(weights, ids, logits, packed),
        "bypassed": BypassedTopKOutput(x, logits, TopKConfig(top_k=TOP_K)),
        "triton_kernel": TritonKernelTopKOutput(None, ids.flatten(), ids.flatten(), weights.flatten(), TOP_K),
        "packed": PackedTopKOutput(packed, logits),
    }


def test_only_the_standard_formats_carry_expert_ids():
    x, logits = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, 16)
    for name, topk_output in _formats(x, logits).items():
        dispatch = StandardDispatchOutput(x, None, topk_output)
        for ids in (moe_staging.routed_ids(dispatch), moe_staging.routed_ids(dispatch_output=dispatch)):
            assert (ids is not None) == name.startswith("standard"), name


def _forward(x, weights, stores, experts, format_name):
    """The residual MoE stack with each eligible layer's kernel reached through `run_moe_core_staged`, as
    SGLang's `FusedMoE.run_moe_core(dispatch_output)` is, its router output in `format_name`."""
    tensors = {lid: w[:2] for lid, w in weights.items()} | {s.layer_id: (s.w13, s.w2) for s in stores}
    experts.engine.begin_forward(x.shape[0])
    for lid in LAYERS:
        dispatch = StandardDispatchOutput(x, None, _formats(x, x @ weights[lid][2].T)[format_name])
        layer = experts.layers.get(lid, SimpleNamespace(layer_id=lid))

        def kernel(_layer, _dispatch, lid=lid, x=x):
            return moe_forward(x, weights[lid][2], *tensors[lid], TOP_K)

        x = x + moe_staging.run_moe_core_staged(experts, kernel, layer, dispatch)
    return x


@pytest.mark.parametrize("policy", ["routed", "auto"])
def test_layers_without_expert_ids_get_whole_steps_with_their_copies_prefetched(model, policy):
    _backend, _weights, layout, stores = model
    offload(stores, layout.bound_groups)
    engine = StagingEngine(stores, "async", staging=policy, top_k=TOP_K)
    if policy == "auto":  # a bucket whose measured window makes routed the cheaper mode for this step size
        engine.chooser.observe_whole(0, TOKENS, stores[0].staged_bytes(), copy_s=1.0, wait_s=1.0)
        engine.chooser._last_whole_step[TOKENS.bit_length()] = 10**9  # no re-measure due
        engine.chooser.measure_steps = False
        assert engine.chooser.choose(1, TOKENS, stores[0].staged_bytes(), 1, 1) == ROUTED
    stats = _serve(model, engine, "bypassed", steps=4)
    # the first step was chosen routed before any layer was seen (a served step comes after graph capture,
    # which runs every layer's hook once); from then on whole, each layer's copy prefetched
    assert stats.unprefetched == len(stores), f"{stats.unprefetched} unprefetched whole copies over 4 steps"
    assert stats.by_mode[ROUTED]["steps"] == 1 and stats.by_mode[WHOLE]["steps"] == 3, stats.by_mode
    assert engine.chooser.layers_without_ids == {s.layer_id for s in stores}
    assert engine.chooser.choose(99, TOKENS, stores[0].staged_bytes(), 1, 1) == WHOLE
    engine.close()


def test_standard_ids_keep_routed_steps(model):
    _backend, _weights, layout, stores = model
    offload(stores, layout.bound_groups)
    engine = StagingEngine(stores, "async", staging="routed", top_k=TOP_K)
    stats = _serve(model, engine, "standard", steps=3)
    assert stats.by_mode[ROUTED]["steps"] == 3 and stats.unprefetched == 0
    engine.close()


def test_global_ids_under_expert_parallelism_count_as_no_ids(model):
    """Under EP, a runner that keeps global expert ids (SGLang's StandardDispatcher skips its local mapping)
    hands STANDARD ids that are not this rank's rows: the layer stages whole, as for a format without ids."""
    import inspect

    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatcher

    assert "self.skip_local_expert_mapping =" in inspect.getsource(StandardDispatcher.__init__)
    _backend, _weights, layout, stores = model
    offload(stores, layout.bound_groups)
    engine = StagingEngine(stores, "async", staging="routed", top_k=TOP_K)
    ep_global = {"moe_ep_size": 2, "dispatcher": SimpleNamespace(skip_local_expert_mapping=True)}
    stats = _serve(model, engine, "standard", steps=3, **ep_global)
    assert engine.chooser.layers_without_ids == {s.layer_id for s in stores}
    assert stats.by_mode[WHOLE]["steps"] == 2, stats.by_mode
    engine.close()
    engine = StagingEngine(stores, "async", staging="routed", top_k=TOP_K)  # mapped (local) ids stay routed
    ep_local = {"moe_ep_size": 2, "dispatcher": SimpleNamespace(skip_local_expert_mapping=False)}
    assert _serve(model, engine, "standard", steps=3, **ep_local).by_mode[ROUTED]["steps"] == 3
    engine.close()


def _serve(model, engine, format_name, steps, **layer_attrs):
    """`steps` forwards through the staging hooks, each bit for bit against the unpaged stack; the stats."""
    backend, weights, layout, stores = model
    layers = {s.layer_id: SimpleNamespace(layer_id=s.layer_id, **layer_attrs) for s in stores}
    experts = moe_staging.ModelExperts(backend, layout, None, stores, engine, layers)
    for seed in range(steps):
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(_forward(x, weights, stores, experts, format_name), _forward_reference(x, weights))
    return engine.stats()


def _forward_reference(x, weights):
    for lid in LAYERS:
        x = x + moe_forward(x, weights[lid][2], *weights[lid][:2], TOP_K)
    return x
