"""gpu_check section `sglang_fp8_moe` (issue 48): SGLang's own kernels over paged block-FP8 experts, the
paths the server runs and the other sections replace with torch stand-ins. Needs SGLang 0.5.23 importable
(`pip install sglang==0.5.23`, or run with the project's environment): without it the section says so and
is skipped. It runs after the check that the rest of gpu_check imports no SGLang.

- `fused_moe_split_w2`: SGLang's Triton fused MoE (`fused_experts`, use_fp8_w8a8 with 128x128 blocks, the
  runner of Fp8MoEMethod on Hopper) over each eligible layer's paged FP8 experts, offloaded half stale until
  staged, with the staging engine's split waits: `before_moe` waits for w13 only, and the down GEMM waits for
  w2 through `moe_staging.invoke_fused_moe_kernel_staged`, placed on SGLang's `invoke_fused_moe_kernel`
  module global as the server's hook places it. Bit for bit against the same call over resident experts;
  every layer's w2 wait taken at its down GEMM (no missed wait).
- `routed_gather_fp8`: routed-only staging through SGLang's `paged_experts_gather` (`GatherCopier`) with FP8
  host rows: exactly the routed offloaded rows land, byte for byte; the copy replayed in a CUDA graph over
  new router ids."""

from __future__ import annotations

import torch

from eval.gpu_sections.toy_moe import fill_slots, toy_layers
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.routed import routed_offloaded_runs
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores

EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 64, 1024, 512, 4, 16
LAYERS = [0, 1, 2, 3]
_KERNEL_MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"


def check(backend: PageBackend, gpu: bool) -> dict:
    """SGLang's block-FP8 Triton fused MoE with the split-w2 break over paged FP8 experts, and SGLang's
    routed gather with FP8 host rows (needs SGLang)."""
    try:
        import importlib

        kernels = importlib.import_module(_KERNEL_MODULE)
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
        from sglang.srt.layers.moe.topk import StandardTopKOutput
        from sglang.test.test_utils import published_topology

        from vamp_sglang.integration.staging import moe_staging
        from vamp_sglang.integration.staging.routed_gather import GatherCopier
    except (ImportError, OSError) as exc:
        return {"skipped": f"needs SGLang 0.5.23 ({exc})"}
    gen = torch.Generator(device=backend.device).manual_seed(11)
    weights, layout = toy_layers(backend, LAYERS, EXPERTS, HIDDEN, INTER, torch.bfloat16, gen, fp8=True)
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    for store in stores:
        for handle in store.offload_tail_pages(layout.bound_groups):
            backend.release(handle)
    try:
        with published_topology(tp_size=1):  # SGLang's runtime context, which its MoE kernels read
            result = {"offloaded_experts": EXPERTS - stores[0].boundary_expert,
                      "fused_moe_split_w2": _fused_moe(backend, weights, stores, layout, gen, kernels,
                                                       moe_staging, MoeRunnerConfig, StandardTopKOutput),
                      "routed_gather_fp8": _routed_gather(weights, stores, GatherCopier, gen)}
    finally:
        close_expert_stores(staging, stores)
    result["ok"] = all(v for case in ("fused_moe_split_w2", "routed_gather_fp8")
                       for v in result[case].values() if isinstance(v, bool))
    return result


def _fused_moe(backend, weights, stores, layout, gen, kernels, moe_staging, config_type, topk_type) -> dict:
    engine = StagingEngine(stores, "async", split_w2_wait=True)
    experts = moe_staging.ModelExperts(backend, layout, None, stores, engine, {s.layer_id: s for s in stores},
                                       {s.w2.data_ptr(): s.layer_id for s in stores})
    original = kernels.invoke_fused_moe_kernel
    waits = []

    def staged(a, b, *args, **kwargs):
        waits.append(experts.w2_owners.get(b.data_ptr()))
        return moe_staging.invoke_fused_moe_kernel_staged(experts, original, a, b, *args, **kwargs)

    paged = {s.layer_id: (s.w13, s.w2) for s in stores}
    config = config_type(num_experts=EXPERTS, num_local_experts=EXPERTS, top_k=TOP_K, inplace=True)

    def forward(x: torch.Tensor, staging: bool) -> torch.Tensor:
        if staging:
            engine.begin_forward(x.shape[0])
        for lid in LAYERS:
            w13, w2, router, s13, s2 = weights[lid]
            if staging:
                w13, w2 = paged.get(lid, (w13, w2))
            logits = x @ router.T
            topk_weights, topk_ids = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K)
            if staging:
                engine.before_moe(lid)
            topk = topk_type(topk_weights, topk_ids.to(torch.int32), logits)
            out = kernels.fused_experts(x.clone(), w13, w2, topk, config, use_fp8_w8a8=True, w1_scale=s13,
                                        w2_scale=s2, block_shape=[128, 128])
            if staging:
                engine.after_moe(lid)
            x = x + out
        return x

    exact = []
    kernels.invoke_fused_moe_kernel = staged
    try:
        for seed in range(3):
            fill_slots(stores, 7.0)  # stale rows: only the staged copy makes an offloaded expert right
            x = torch.randn(TOKENS, HIDDEN, device=backend.device, dtype=torch.bfloat16, generator=gen)
            paged_out = forward(x, staging=True)
            exact.append(torch.equal(paged_out, forward(x, staging=False)))
    finally:
        kernels.invoke_fused_moe_kernel = original
    torch.cuda.synchronize()
    eligible = {s.layer_id for s in stores}
    result = {"exact": all(exact), "no_missed_w2_wait": engine.missed_w2_waits == 0,
              "w2_waits_at_down_gemm": sum(1 for w in waits if w in eligible) == 3 * len(eligible),
              "split_stayed_on": engine.split_w2_wait}
    engine.close()
    return result


def _routed_gather(weights, stores, copier_type, gen) -> dict:
    copier, store = copier_type(stores), stores[0]
    dev = store.w13.device
    ids = torch.zeros(TOKENS, TOP_K, dtype=torch.int32, device=dev)
    copier(store, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copier(store, ids)
    w13, w2 = weights[store.layer_id][:2]
    exact, copied = [], 0
    for _ in range(3):
        fill_slots(stores, 7.0)
        ids.copy_(torch.randint(0, EXPERTS, (TOKENS, TOP_K), device=dev, dtype=torch.int32, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        for first, end in routed_offloaded_runs(ids.cpu(), store.boundary_expert, EXPERTS):
            copied += end - first
            exact.append(all(torch.equal(paged[first:end].view(torch.uint8), ref[first:end].view(torch.uint8))
                             for paged, ref in ((store.w13, w13), (store.w2, w2))))
    return {"fp8_rows_exact": bool(exact) and all(exact), "rows_copied": copied,
            "experts_are_fp8": store.w13.dtype == torch.float8_e4m3fn}
