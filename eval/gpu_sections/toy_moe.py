"""The toy MoE layers the gpu_check sections share: a grouped expert MLP, a capturable top-k MoE over it,
random layers with their ExpertLayout, the KV row shape of the toy model, and stale staging slots.

FP8 (issue 20): `toy_layers(..., fp8=True)` block-quantises the same experts (e4m3, one float32 scale per
128x128 block, as DeepSeek-V3 and Qwen3-FP8 checkpoints); each layer's tuple then carries the two scale
tensors after the router, and `routed_moe(..., scales=...)` dequantises inside the forward, so a capture
reads the paged FP8 bytes at every replay while the scales stay resident."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vamp_sglang.block_fp8 import dequantise
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.tiny_moe.fp8 import quantise

KV_ROW_SHAPE = (8, 128)  # [kv heads, head dim] bf16: 2 KiB per token


def moe_layer(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              between: Callable[[], None] | None = None) -> torch.Tensor:
    """Grouped expert MLP: x [E, T, H], w13 [E, 2I, H], w2 [E, H, I] -> [E, T, H] (SiLU-gated).
    `between` runs after the gate-up GEMM (the split w2 wait, paper V-B)."""
    gate_up = torch.bmm(x, w13.transpose(1, 2))  # [E, T, 2I]
    inter = gate_up.shape[-1] // 2
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]  # [E, T, I]
    if between is not None:
        between()
    return torch.bmm(act, w2.transpose(1, 2))  # [E, T, H]


def routed_moe(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               between: Callable[[], None] | None = None, scales: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Top-k MoE with static shapes and no host sync (capturable): every expert runs, the routing
    weights are zero off the top-k. x [T, H] -> [T, H]; reads every expert, offloaded ones included
    (a NaN in any expert row reaches the output, weight 0 or not). With `scales` (w13's, w2's) the
    experts are block FP8, dequantised here (W8A16)."""
    if scales:
        w13, w2 = dequantise(w13, scales[0], x.dtype), dequantise(w2, scales[1], x.dtype)
    weights, ids = torch.topk(torch.softmax(x @ router.T, dim=-1), top_k)
    dense = torch.zeros(x.shape[0], router.shape[0], dtype=x.dtype, device=x.device).scatter_(1, ids, weights)
    out = moe_layer(x.unsqueeze(0).expand(router.shape[0], -1, -1).contiguous(), w13, w2, between)
    return (dense.T.unsqueeze(-1) * out).sum(0)


def toy_layers(backend: PageBackend, layer_ids: list[int], experts: int, hidden: int, inter: int,
               dtype: torch.dtype, gen: torch.Generator, fp8: bool = False) -> tuple[dict, ExpertLayout]:
    """{layer: (w13, w2, router)} with random weights, and their layout with up to half offloadable;
    `fp8`: {layer: (w13 fp8, w2 fp8, router, w13 scales, w2 scales)}, the layout in FP8 bytes."""
    dev = backend.device
    weights = {lid: (torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen, dtype=dtype) / 32,
                     torch.randn(experts, hidden, inter, device=dev, generator=gen, dtype=dtype) / 16,
                     torch.randn(experts, hidden, device=dev, generator=gen, dtype=dtype)) for lid in layer_ids}
    if fp8:
        weights = {lid: (*_quantised(w13, w2), router) for lid, (w13, w2, router) in weights.items()}
        weights = {lid: (q13, q2, router, s13, s2) for lid, ((q13, s13), (q2, s2), router) in weights.items()}
    w13_0, w2_0 = weights[layer_ids[0]][:2]
    layout = ExpertLayout.compute(layer_ids, experts, w13_0[0].numel() * w13_0.element_size(),
                                  w2_0[0].numel() * w2_0.element_size(), backend.granularity_bytes, 0.5, experts)
    return weights, layout


def _quantised(*weights: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each [E, N, K] weight as (FP8 [E, N, K], scales [E, N/128, K/128]), expert by expert."""
    out = []
    for weight in weights:
        pairs = [quantise(w) for w in weight]
        out.append((torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])))
    return out


def fill_slots(stores, value: float) -> None:
    """Make every staging slot stale (`value` in every offloaded row), so only a staging copy can make an
    output right. The fill runs on the compute stream, which the copy stream is not ordered after:
    finish it before any copy is issued."""
    for store in stores:
        for dst, _ in store.staging_pairs():
            dst.fill_(value)
    stores[0].backend.synchronize()
