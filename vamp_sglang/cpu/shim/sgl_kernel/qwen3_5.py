"""Qwen3.5's four `torch.ops.sgl_kernel` CPU ops, registered when the stand-in `sgl_kernel` is imported.

SGLang 0.5.23 reads them at import of models/qwen3_5.py (line 283), after other SGLang modules have imported
`sgl_kernel`, so `sgl_kernel/__init__` imports this module. The math is vamp_sglang.cpu.qwen3_5_ops (plain
torch). None of them is `convert_weight_packed`, so SGLang's Intel AMX backend stays off.
"""

from __future__ import annotations

import torch

from vamp_sglang.cpu import qwen3_5_ops as _ops

TORCH_OPS = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
             "fused_qkvzba_split_reshape_cat_contiguous_cpu")


def _register() -> None:
    """Register the four ops once per process (a second import of this file must not re-register)."""
    if all(hasattr(torch.ops.sgl_kernel, name) for name in TORCH_OPS):
        return

    @torch.library.custom_op("sgl_kernel::fused_sigmoid_mul_cpu", mutates_args=("x",))
    def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
        _ops.fused_sigmoid_mul(x, gate)

    @torch.library.custom_op("sgl_kernel::fused_qk_gemma_rmsnorm_cpu", mutates_args=())
    def fused_qk_gemma_rmsnorm_cpu(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                                   k_weight: torch.Tensor, eps: float,
                                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _ops.fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim)

    @torch.library.custom_op("sgl_kernel::fused_qk_gemma_rmsnorm_with_gate_cpu", mutates_args=())
    def fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
        head_dim: int, num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _ops.fused_qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps, head_dim, num_heads)

    @torch.library.custom_op("sgl_kernel::fused_qkvzba_split_reshape_cat_contiguous_cpu", mutates_args=())
    def fused_qkvzba_split_reshape_cat_contiguous_cpu(
        mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int, num_heads_v: int, head_qk: int,
        head_v: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _ops.fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v,
                                                               head_qk, head_v)


_register()
