"""Qwen3.5's four fused sgl-kernel CPU ops in plain torch, for SGLang 0.5.23's CPU path.

`models/qwen3_5.py:283` binds these from `torch.ops.sgl_kernel` when SGLang runs on CPU, at import time,
so without them the model module does not even import. PyPI ships no sgl-kernel CPU build; our stand-in
registers these (`sgl_kernel.qwen3_5`). Each keeps the argument order SGLang calls it with and the math
of the kernel SGLang runs on other devices:

- `fused_sigmoid_mul`: attention output gating, x *= sigmoid(gate), in place (the Triton kernel in
  kernels/ops/elementwise/elementwise.py; the gate may be the `[T, heads, head_dim]` strided view of the
  query/gate projection);
- `fused_qk_gemma_rmsnorm`: Gemma RMSNorm of every query and key head, x / sqrt(mean(x^2) + eps) *
  (1 + w) in float32 (models/utils.py, the math of `GemmaRMSNorm.forward_native`);
- `fused_qk_gemma_rmsnorm_with_gate`: the same, reading queries from the per-head interleaved
  `[q_h0, gate_h0, q_h1, gate_h1, ...]` projection and returning the gate halves contiguous;
- `fused_qkvzba_split_reshape_cat_contiguous`: the Gated DeltaNet input split for Qwen3.5's contiguous
  layout (`[all_q | all_k | all_v | all_z]`, `[all_b | all_a]`; kernels/ops/attention/
  triton_gdn_fused_proj.py) into mixed qkv, z `[T, HV, V]`, b and a `[T, HV]`.

Every result is a fresh contiguous tensor, a copy even where a view would do (what the kernels return; a
custom op may not alias its inputs, and a one-token batch's slices are already contiguous).
"""

from __future__ import annotations

import torch


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def fused_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x `[T, H*D]` *= sigmoid(gate), gate `[T, H*D]` or `[T, H, D]` (any strides); computed in float32."""
    gated = x.float() * torch.sigmoid(gate.float()).reshape(x.shape)
    x.copy_(gated.to(x.dtype))


def _gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows of x normalised over the last dim and scaled by (1 + weight), in float32, back in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def fused_qk_gemma_rmsnorm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, Hq*D]`, k `[T, Hk*D]` -> per-head normalised `[T*Hq, D]`, `[T*Hk, D]`."""
    return (_gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps),
            _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps))


def fused_qk_gemma_rmsnorm_with_gate(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                                     k_weight: torch.Tensor, eps: float, head_dim: int,
                                     num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_gate `[T, Hq*2D]` (each head's query then its gate) and k `[T, Hk*D]` -> normalised queries
    `[T*Hq, D]`, normalised keys `[T*Hk, D]` and the gates `[T*Hq, D]`."""
    per_head = q_gate.reshape(q_gate.shape[0], num_heads, 2 * head_dim)
    query, gate = per_head[..., :head_dim], per_head[..., head_dim:]
    q_out, k_out = fused_qk_gemma_rmsnorm(query.reshape(-1, head_dim), k, q_weight, k_weight, eps, head_dim)
    return q_out, k_out, _fresh(gate.reshape(-1, head_dim))


def fused_qkvzba_split_reshape_cat_contiguous(
    mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int, num_heads_v: int, head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[T, 2*Hk*K + 2*HV*V]` and `[T, 2*HV]` -> qkv `[T, 2*Hk*K + HV*V]`, z `[T, HV, V]`, b, a `[T, HV]`."""
    qkv_width = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    expected = (qkv_width + num_heads_v * head_v, 2 * num_heads_v)
    if (mixed_qkvz.shape[-1], mixed_ba.shape[-1]) != expected:
        raise ValueError(f"qkvzba split: widths {mixed_qkvz.shape[-1]}, {mixed_ba.shape[-1]} do not match "
                         f"{num_heads_qk} key heads of {head_qk} and {num_heads_v} value heads of {head_v} "
                         f"(expected {expected[0]}, {expected[1]})")
    tokens = mixed_qkvz.shape[0]
    qkv = _fresh(mixed_qkvz[:, :qkv_width])
    z = _fresh(mixed_qkvz[:, qkv_width:].reshape(tokens, num_heads_v, head_v))
    b, a = (_fresh(part) for part in mixed_ba.split([num_heads_v, num_heads_v], dim=-1))
    return qkv, z, b, a
