"""FP8 checkpoints on a CPU without Intel AMX: SGLang's own FP8 methods, with their two CPU ops in torch.

SGLang 0.5.23 loads a block-quantised FP8 checkpoint on CPU with `Fp8LinearMethod` and `Fp8MoEMethod`,
then asserts Intel AMX (layers/quantization/fp8.py:827 linear, :2185 MoE) and marks the layer for the
sgl-kernel CPU ops via `_amx_process_weight_after_loading`. Without AMX we keep SGLang's path and answer
only those pieces:
- around each method's `process_weights_after_loading` (and only there, so no other layer changes
  path), fp8's `_is_cpu_amx_available` reads True and `_amx_process_weight_after_loading` just sets
  `layer.use_intel_amx_backend` (no VNNI packing: the weights stay in the checkpoint's layout, which is
  what VAMP pages). A global `cpu_has_amx_support()` would send every unquantised layer to AMX ops;
- `sgl_kernel::fp8_scaled_mm_cpu` (called at fp8.py:1402), `sgl_kernel::fused_experts_cpu` with
  `CPUQuantMethod.FP8_W8A16` (fp8.py:3117) and DeepSeek's `sgl_kernel::shared_expert_cpu` (taken once its
  shared expert is marked, models/deepseek_v2.py:1311), registered as torch custom ops: dequantise each 128x128
  block (W8A16: activations stay bf16), then the matmuls SGLang's unquantised CPU path runs
  (`F.linear`, unquant.py:537; `moe_forward_native`, layers/moe/fused_moe_native.py:61), expert by
  expert, so a model and its exact bf16 dequantisation give the same tokens.
Per-tensor FP8 (no `weight_block_size`) is refused at load: its CPU op is not answered here.
Placed by the plugin only in CPU mode; on a GPU SGLang's FP8 kernels stay in charge.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from vamp_sglang.block_fp8 import dequantise
from vamp_sglang.integration.hooks import Hook

FP8_W8A16 = 2  # sglang.srt.layers.amx_utils.CPUQuantMethod.FP8_W8A16


class Fp8CpuError(NotImplementedError):
    """An FP8 layout the CPU ops here do not answer; the message names it."""


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: list[int],
                  bias: torch.Tensor | None, out_dtype: torch.dtype, is_vnni: bool) -> torch.Tensor:
    """`x @ dequant(weight).T + bias` for weight [N, K] float8 with one scale per block_size block."""
    w = dequantise(weight, weight_scale_inv, x.dtype, tuple(block_size))
    return torch.nn.functional.linear(x, w, bias).to(out_dtype)


class _DequantisedExperts:
    """`layer.w13_weight[e]` for `moe_forward_native`: expert e dequantised when it is read, so a step
    dequantises only the experts its router selected."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
        self.weight, self.scale_inv, self.block, self.dtype = weight, scale_inv, block, dtype

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantise(self.weight[expert], self.scale_inv[expert], self.dtype, self.block)


def fused_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, inplace: bool, moe_comp_method: int, w1_scale: torch.Tensor | None,
                  w2_scale: torch.Tensor | None, w1_zp: torch.Tensor | None, w2_zp: torch.Tensor | None,
                  block_size: list[int] | None, w1_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                  alpha: float | None, limit: float | None, is_vnni: bool, activation: str) -> torch.Tensor:
    """The routed experts of one layer, FP8 W8A16 with block scales, as SGLang's native MoE runs them."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native

    if moe_comp_method != FP8_W8A16 or w1_scale is None or w2_scale is None or not block_size:
        raise Fp8CpuError(f"vamp CPU fused_experts_cpu answers block-quantised FP8 only (method "
                          f"{moe_comp_method}, block_size {block_size})")
    if w1_zp is not None or w2_zp is not None:
        raise Fp8CpuError("vamp CPU fused_experts_cpu: FP8 with zero points is not supported")
    block = (int(block_size[0]), int(block_size[1]))
    dtype = hidden_states.dtype
    layer = SimpleNamespace(num_experts=w1.shape[0], w13_weight=_DequantisedExperts(w1, w1_scale, block, dtype),
                            w2_weight=_DequantisedExperts(w2, w2_scale, block, dtype),
                            w13_weight_bias=w1_bias, w2_weight_bias=w2_bias)
    config = SimpleNamespace(apply_router_weight_on_input=False, activation=activation, gemm1_alpha=alpha,
                             gemm1_clamp_limit=limit)
    return moe_forward_native(layer, hidden_states, (topk_weights, topk_ids, None), config)


def shared_expert(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, fused_experts_out: torch.Tensor,
                  routed_scaling_factor: float, inplace: bool, use_int8_w8a8: bool, use_fp8_w8a16: bool,
                  w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, block_size: list[int] | None,
                  is_vnni: bool) -> torch.Tensor:
    """DeepSeek's CPU MoE tail (models/deepseek_v2.py:1486, taken once its shared expert is FP8 here):
    routed x routed_scaling_factor + the shared expert, in the order the unquantised CPU path runs them
    (`final *= routed_scaling_factor`, deepseek_v2.py:1422, then the shared output added)."""
    from sglang.srt.layers.activation import SiluAndMul

    if not use_fp8_w8a16 or use_int8_w8a8 or w1_scale is None or w2_scale is None or not block_size:
        raise Fp8CpuError("vamp CPU shared_expert_cpu answers a block-quantised FP8 shared expert only")
    block = (int(block_size[0]), int(block_size[1]))
    dtype = hidden_states.dtype
    gate_up = torch.nn.functional.linear(hidden_states, dequantise(w1, w1_scale, dtype, block))
    shared = torch.nn.functional.linear(SiluAndMul().forward_native(gate_up), dequantise(w2, w2_scale, dtype, block))
    return fused_experts_out * routed_scaling_factor + shared


@functools.cache
def register_ops() -> None:
    """`torch.ops.sgl_kernel.fp8_scaled_mm_cpu`, `.fused_experts_cpu` and `.shared_expert_cpu`, once per process.
    `convert_weight_packed` stays unregistered (the shim's mamba module registers only its two ops), so
    SGLang keeps AMX off everywhere else (utils/common.py:354-358)."""
    torch.library.custom_op("sgl_kernel::fp8_scaled_mm_cpu", mutates_args=(), device_types="cpu")(fp8_scaled_mm)
    torch.library.custom_op("sgl_kernel::fused_experts_cpu", mutates_args=(), device_types="cpu")(fused_experts)
    torch.library.custom_op("sgl_kernel::shared_expert_cpu", mutates_args=(), device_types="cpu")(shared_expert)


def _use_cpu_ops(module: torch.nn.Module, weight_names: list[str], *args, **kwargs) -> None:
    """fp8's `_amx_process_weight_after_loading`, answered: route the layer to the CPU ops, unpacked."""
    module.use_intel_amx_backend = True


def process_weights_for_cpu_ops(original, method, layer, *args, **kwargs):
    """Around `Fp8LinearMethod` / `Fp8MoEMethod.process_weights_after_loading`: SGLang's CPU branch,
    with AMX answered by the ops above for this layer only."""
    from sglang.srt.layers.quantization import fp8 as sglang_fp8

    if not getattr(method, "block_quant", False):
        raise Fp8CpuError(f"vamp CPU mode serves block-quantised FP8 only (weight_block_size); "
                          f"{type(method).__name__} here has per-tensor scales")
    register_ops()
    saved = sglang_fp8._is_cpu_amx_available, sglang_fp8._amx_process_weight_after_loading
    sglang_fp8._is_cpu_amx_available, sglang_fp8._amx_process_weight_after_loading = True, _use_cpu_ops
    try:
        return original(method, layer, *args, **kwargs)
    finally:
        sglang_fp8._is_cpu_amx_available, sglang_fp8._amx_process_weight_after_loading = saved


_FP8 = "sglang.srt.layers.quantization.fp8"
HOOKS = [
    Hook(f"{_FP8}.Fp8LinearMethod.process_weights_after_loading", "around", process_weights_for_cpu_ops,
         "CPU mode: block-FP8 linear layers run SGLang's CPU branch with its AMX op answered in torch"),
    Hook(f"{_FP8}.Fp8MoEMethod.process_weights_after_loading", "around", process_weights_for_cpu_ops,
         "CPU mode: block-FP8 experts run SGLang's CPU branch with fused_experts_cpu answered in torch"),
]
