# ruff: noqa: F811  (fp8_moe takes the imported sglang_moe fixture as an argument)
"""FP8 experts (issue 20) on SGLang's own objects, in one process and on real host pages.

Three real `FusedMoE` layers built by SGLang with `Fp8MoEMethod` (block-quantised, 128x128 scales) run
SGLang's FP8 `apply`, whose CPU branch calls our `sgl_kernel::fused_experts_cpu`. `convert_experts`
pages their FP8 weights; offloaded experts are staged (whole region or routed rows) and restored, and
every output equals the unpaged layers' bit for bit, with the block scales resident throughout.
"""

import pytest
import torch
from test_integration_memory import sglang_moe  # noqa: F401 (the fixture: dist groups for SGLang layers)

from vamp_sglang.block_fp8 import dequantise
from vamp_sglang.cpu import fp8 as cpu_fp8
from vamp_sglang.integration.memory import expert_memory as em
from vamp_sglang.integration.memory import expert_memory_hooks as hooks
from vamp_sglang.integration.staging import moe_staging
from vamp_sglang.memory.backend import LiveCounts
from vamp_sglang.memory.host_backend import HostPageBackend
from vamp_sglang.tiny_moe.fp8 import quantise

GRAN = 64 << 10
E, H, I, LAYERS, TOP_K = 16, 128, 128, 3, 2  # FP8 w13 shard 32 KiB, w2 16 KiB: a group is 4 experts
RATIO = 0.5  # bound: 2 of the 4 groups


@pytest.fixture(scope="module")
def fp8_moe(sglang_moe):
    """SGLang's FusedMoE and Fp8Config, over the model-parallel groups `sglang_moe` builds, with our ops."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    cpu_fp8.register_ops()
    return sglang_moe[0], Fp8Config


def make_fp8_layers(fp8_moe, block=(128, 128)):
    """SGLang's FP8 FusedMoE layers holding quantised random experts, routed to the CPU ops as our
    load hook routes them (`use_intel_amx_backend`)."""
    FusedMoE, Fp8Config = fp8_moe
    config = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                       weight_block_size=list(block) if block else None)
    g = torch.Generator().manual_seed(0)
    layers = torch.nn.ModuleList(
        FusedMoE(num_experts=E, hidden_size=H, intermediate_size=I, layer_id=i, top_k=TOP_K,
                 params_dtype=torch.bfloat16, quant_config=config) for i in range(LAYERS))
    if not block:
        return layers
    for layer in layers:
        for name in ("w13_weight", "w2_weight"):
            weight, scale = getattr(layer, name), getattr(layer, f"{name}_scale_inv")
            for e in range(E):
                q, s = quantise(torch.randn(weight.shape[1:], generator=g) * 0.1)
                weight.data[e].copy_(q)
                scale.data[e].copy_(s)
        layer.use_intel_amx_backend = True
    return layers


def routed(g, tokens):
    out = []
    for _ in range(LAYERS):
        logits = torch.randn(tokens, E, generator=g)
        w, ids = torch.topk(torch.softmax(logits, -1), TOP_K)
        out.append((w, ids.to(torch.int32), logits))
    return out


def forward(layers, x, topk, experts=None):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    if experts is not None:
        experts.engine.begin_forward(x.shape[0])
    return [layer(x, StandardTopKOutput(*t)) for layer, t in zip(layers, topk)]


def plain_reference(layer, x, w, ids):
    """The routed experts in float32 on the dequantised weights, token by token."""
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(TOP_K):
            e = int(ids[t, k])
            w13 = dequantise(layer.w13_weight[e], layer.w13_weight_scale_inv[e])
            w2 = dequantise(layer.w2_weight[e], layer.w2_weight_scale_inv[e])
            gate, up = (x[t].float() @ w13.T).chunk(2)
            out[t] += float(w[t, k]) * ((torch.nn.functional.silu(gate) * up) @ w2.T)
    return out


def test_sglangs_fp8_moe_through_our_cpu_op_matches_plain_torch_on_the_dequantised_weights(fp8_moe):
    layers = make_fp8_layers(fp8_moe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    topk = routed(g, 6)
    out = forward(layers, x, topk)[0]
    reference = plain_reference(layers[0], x, *topk[0][:2])
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), reference, rtol=2e-2, atol=2e-2), (out.float() - reference).abs().max()


def test_the_linear_op_is_f_linear_on_the_exactly_dequantised_weight():
    cpu_fp8.register_ops()
    g = torch.Generator().manual_seed(2)
    q, s = quantise(torch.randn(256, 384, generator=g) * 0.05)
    x = torch.randn(5, 384, generator=g).to(torch.bfloat16)
    bias = torch.randn(256, generator=g).to(torch.bfloat16)
    out = torch.ops.sgl_kernel.fp8_scaled_mm_cpu(x, q, s, [128, 128], bias, torch.bfloat16, True)
    assert torch.equal(out, torch.nn.functional.linear(x, dequantise(q, s, torch.bfloat16), bias))
    exact = dequantise(q, s)
    assert torch.equal(dequantise(q, s, torch.bfloat16).float(), exact), "power-of-two scales are exact in bf16"


@pytest.mark.parametrize("policy", ["whole", "routed", "auto"])
def test_paged_fp8_experts_offloaded_staged_and_restored_give_the_unpaged_output(fp8_moe, monkeypatch, policy):
    FusedMoE, _ = fp8_moe
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    layers = make_fp8_layers(fp8_moe)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, H, generator=g).to(torch.bfloat16)
    topk = routed(g, 32)
    assert int(torch.cat([t[1].flatten() for t in topk]).max()) == E - 1, "routing must reach offloaded experts"
    reference = forward(layers, x, topk)
    originals = [(layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()) for layer in layers]
    scales = [(layer.w13_weight_scale_inv, layer.w2_weight_scale_inv) for layer in layers]
    scale_values = [(a.detach().clone(), b.detach().clone()) for a, b in scales]

    backend = HostPageBackend("cpu", granularity_bytes=GRAN)
    experts = moe_staging.convert_experts(layers, backend, RATIO, staging_policy=policy)
    assert experts.layout.w13_shard_bytes == 2 * I * H and experts.layout.w2_shard_bytes == H * I  # 1 B each
    assert (experts.layout.group_experts, experts.layout.bound_groups) == (4, 2)
    monkeypatch.setattr(hooks, "_process", hooks._Process(backend, experts))
    monkeypatch.setattr(MHATokenToKVPool, "_create_buffers_normal",
                        _wrap_fn(MHATokenToKVPool._create_buffers_normal, hooks._around_create_buffers_normal,
                                 HookType.AROUND))
    monkeypatch.setattr(FusedMoE, "run_moe_core",
                        _wrap_fn(FusedMoE.run_moe_core, hooks._around_run_moe_core, HookType.AROUND))
    pool = MHATokenToKVPool(256, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=LAYERS,
                            device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(256, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False)
    memory = em.ExpertMemory(experts, hooks._process.pool, alloc, publish=dict, quiesce=lambda: None)
    try:
        staged_before = experts.engine.stats().bytes_staged
        for groups in (1, 1, -1, -1):  # one group, the bound, back to one, none
            if groups > 0:
                memory.offload(groups, memory.tokens_for(groups))
            else:
                memory.restore(-groups)
            for store in experts.stores:  # poison the staging slots: only a staging copy fixes them
                for dst, _ in store.staging_pairs():
                    dst.fill_(float("nan"))
            outs = forward(layers, x, topk, experts)
            assert all(torch.equal(a, b) for a, b in zip(outs, reference)), f"{policy}: output changed"
        staged = experts.engine.stats().bytes_staged - staged_before
        assert staged > 0 and staged % (2 * I * H + H * I) == 0, "staged bytes are whole FP8 experts"
        for layer, (w13, w2), (s13, s2), (v13, v2) in zip(layers, originals, scales, scale_values):
            assert torch.equal(layer.w13_weight.view(torch.uint8), w13.view(torch.uint8))
            assert torch.equal(layer.w2_weight.view(torch.uint8), w2.view(torch.uint8))
            assert layer.w13_weight_scale_inv is s13 and layer.w2_weight_scale_inv is s2, "scales stay put"
            assert torch.equal(s13, v13) and torch.equal(s2, v2)
    finally:
        memory.repartitioner.close()
        hooks._process.pool.kv.close()
        experts.close()
    assert backend.live_counts() == LiveCounts(0, 0, 0), "a page was lost or is held twice"
    backend.close()


def test_fp8_with_per_tensor_scales_is_refused_naming_the_method(fp8_moe):
    layers = make_fp8_layers(fp8_moe, block=None)
    backend = HostPageBackend("cpu", granularity_bytes=GRAN)
    try:
        with pytest.raises(moe_staging.ExpertConversionError, match="Fp8MoEMethod with per-tensor scales"):
            moe_staging.convert_experts(layers, backend, RATIO)
        assert backend.live_counts() == LiveCounts(0, 0, 0)
    finally:
        backend.close()


def test_the_cpu_op_refuses_layouts_it_does_not_answer():
    cpu_fp8.register_ops()
    w = torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(cpu_fp8.Fp8CpuError, match="block-quantised FP8 only"):
        cpu_fp8.fused_experts(torch.zeros(1, 128), w, w, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                              False, 0, None, None, None, None, None, None, None, None, None, True, "silu")


def test_deepseeks_fp8_shared_expert_tail_is_the_unquantised_paths_arithmetic(fp8_moe):
    """`shared_expert_cpu` (DeepSeek's CPU MoE tail once its shared expert is FP8) against SGLang's own
    bf16 DeepseekV2MLP on the exactly dequantised weights, with the routed output scaled first as the
    unquantised CPU path does: bit for bit."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2MLP

    g = torch.Generator().manual_seed(5)
    q1, s1 = quantise(torch.randn(2 * I, H, generator=g) * 0.1)
    q2, s2 = quantise(torch.randn(H, I, generator=g) * 0.1)
    mlp = DeepseekV2MLP(H, I, "silu", reduce_results=False).to(torch.bfloat16)
    mlp.gate_up_proj.weight.data.copy_(dequantise(q1, s1, torch.bfloat16))
    mlp.down_proj.weight.data.copy_(dequantise(q2, s2, torch.bfloat16))
    x = torch.randn(5, H, generator=g).to(torch.bfloat16)
    routed = torch.randn(5, H, generator=g).to(torch.bfloat16)
    out = cpu_fp8.shared_expert(x, q1, q2, routed, 2.5, True, False, True, s1, s2, [128, 128], True)
    assert torch.equal(out, routed * 2.5 + mlp(x))
