"""Torch paths for the GPU-only calls SGLang 0.5.23 makes on Qwen3-Next's CPU path.

Two Triton call sites sit outside `sgl_kernel`, so the stand-in cannot answer them, and on a CPU
without sgl-kernel's AMX build they fail ("0 active drivers"):
- the gated RMSNorm after linear attention (`FusedRMSNormGated`, or `RMSNormGated` under piecewise
  graphs): SGLang's torch branch needs `cpu_has_amx_support()`. We run SGLang's own torch reference
  `rms_norm_ref` (kernels/ops/attention/fla/layernorm_gated.py), the math HF's Qwen3NextRMSNormGated has;
- the shared-expert gate of Qwen2/Qwen3-Next MoE (`fused_gate_sigmoid_mul[_add]`, bound by name in
  models/qwen2_moe.py): out = sigmoid(hidden @ gate_weight) * shared_output (added in place to the
  routed output for `_add`).
- MiniMax-M2's QK norm (`MiniMaxM2QKRMSNorm`, models/minimax_m2.py:456-471): off Intel AMX and fused
  CUDA all-reduce its only path is two Triton kernels (`rms_sumsq_serial` asserts CUDA tensors). We run
  SGLang's own torch `MiniMaxM2RMSNormTP.forward` on q and on k, the same math (each normalised by the
  RMS of its whole vector, the variance all-reduced over attention TP ranks).
And `Qwen3GatedDeltaNet.__init__` puts its norm weight on `torch.get_device_module().current_device()`,
the current accelerator's device: with this CUDA build of torch that is CUDA even without a GPU, and
fails. While it builds, the device module with no device named is torch.cpu, as on a CPU-only torch.
They are hooks through SGLang's HookRegistry, placed by our plugin only in CPU mode, so a GPU server
keeps its Triton kernels.
"""

from __future__ import annotations

import contextlib

import torch

from vamp_sglang.integration.hooks import Hook

_SILU = ("silu", "swish")


def _gated_norm(x, weight, bias, gate, eps, group_size, norm_before_gate, activation) -> torch.Tensor:
    from sglang.kernels.ops.attention.fla.layernorm_gated import rms_norm_ref

    if activation not in _SILU:
        raise NotImplementedError(f"vamp CPU gated RMSNorm: activation {activation!r} (only silu/swish)")
    return rms_norm_ref(x, weight, bias, z=gate, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)


def fused_rms_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """`FusedRMSNormGated.forward`: norm(x) * silu(g), no bias or groups (Qwen3-Next never passes a residual)."""
    if residual is not None or prenorm:
        raise NotImplementedError("vamp CPU FusedRMSNormGated: residual/prenorm are not supported")
    return _gated_norm(x, self.weight, self.bias, g, self.eps, None, True, self.activation)


def rms_norm_gated_forward(self, x, z=None):
    """`layernorm_gated.RMSNorm.forward`: norm(x) * silu(z) or norm(x * silu(z)), per group when grouped."""
    return _gated_norm(x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate,
                       self.activation)


def _shared_gate(hidden_states: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(hidden_states @ gate_weight.reshape(-1, 1))


def gate_sigmoid_mul(hidden_states, gate_weight, shared_output) -> torch.Tensor:
    """`fused_gate_sigmoid_mul`: the gated shared-expert output."""
    return _shared_gate(hidden_states, gate_weight) * shared_output


def gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
    """`fused_gate_sigmoid_mul_add`: add the gated shared-expert output to the routed output, in place."""
    final_hidden_states.add_(_shared_gate(hidden_states, gate_weight) * shared_output)


def qk_norm_in_torch(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`MiniMaxM2QKRMSNorm._forward_naive`: q and k each through its `MiniMaxM2RMSNormTP` (torch)."""
    return self._q_norm(q), self._k_norm(k)


@contextlib.contextmanager
def _cpu_as_default_device_module():
    original = torch.get_device_module
    torch.get_device_module = lambda device=None: torch.cpu if device is None else original(device)
    try:
        yield
    finally:
        torch.get_device_module = original


def build_on_cpu(original, *args, **kwargs):
    """Around `Qwen3GatedDeltaNet.__init__`: build with torch.cpu as the default device module."""
    with _cpu_as_default_device_module():
        return original(*args, **kwargs)


_FLA = "sglang.kernels.ops.attention.fla"
_QWEN2_MOE = "sglang.srt.models.qwen2_moe"
HOOKS = [
    Hook("sglang.srt.models.qwen3_next.Qwen3GatedDeltaNet.__init__", "around", build_on_cpu,
         "CPU mode: build linear attention on torch.cpu (this torch's default device module is CUDA)"),
    Hook(f"{_FLA}.fused_norm_gate.FusedRMSNormGated.forward", "replace", fused_rms_norm_gated_forward,
         "CPU mode: Qwen3-Next's gated RMSNorm in torch (SGLang's torch branch needs Intel AMX)"),
    Hook(f"{_FLA}.layernorm_gated.RMSNorm.forward", "replace", rms_norm_gated_forward,
         "CPU mode: the same norm as built under piecewise graphs, in torch"),
    Hook(f"{_QWEN2_MOE}.fused_gate_sigmoid_mul_add", "replace", gate_sigmoid_mul_add,
         "CPU mode: shared-expert sigmoid gate (Triton on every device but NPU/AMX), in torch"),
    Hook(f"{_QWEN2_MOE}.fused_gate_sigmoid_mul", "replace", gate_sigmoid_mul,
         "CPU mode: the out-of-place variant of the same gate, in torch"),
    Hook("sglang.srt.models.minimax_m2.MiniMaxM2QKRMSNorm._forward_naive", "replace", qk_norm_in_torch,
         "CPU mode: MiniMax-M2's whole-vector QK norm through SGLang's torch RMSNormTP (its naive path is Triton)"),
]
