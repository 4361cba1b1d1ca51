"""`sgl_kernel.mamba` and the two `torch.ops.sgl_kernel` Gated DeltaNet ops, for Qwen3-Next on CPU.

SGLang 0.5.23 imports `causal_conv1d_fn_cpu`, `causal_conv1d_update_cpu` (gdn_backend.py, kda_backend.py)
and `chunk_gated_delta_rule_cpu` (gdn_triton.py) from here, and then reads
`torch.ops.sgl_kernel.fused_gdn_gating_cpu` and `torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu`.
The math is vamp_sglang.cpu.linear_attention (plain torch). Importing this module registers exactly those
two ops under `torch.ops.sgl_kernel`, never `convert_weight_packed`, so SGLang's Intel AMX backend
(`cpu_has_amx_support()`) stays off. The decode op is called with keywords, so its schema keeps
SGLang's argument names; a speculative verify (EAGLE/NEXTN chains, gdn_triton.py:217-255) calls it with the
per-draft-token state buffer as well, which it writes (`intermediate_states_buffer`).
"""

from __future__ import annotations

import torch

from vamp_sglang.cpu import linear_attention as _ops

causal_conv1d_fn_cpu = _ops.causal_conv1d_fn
causal_conv1d_update_cpu = _ops.causal_conv1d_update
chunk_gated_delta_rule_cpu = _ops.chunk_gated_delta_rule

TORCH_OPS = ("fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu")


def _register() -> None:
    """Register the two ops once per process (a second import of this file must not re-register)."""
    if all(hasattr(torch.ops.sgl_kernel, name) for name in TORCH_OPS):
        return

    @torch.library.custom_op("sgl_kernel::fused_gdn_gating_cpu", mutates_args=())
    def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _ops.fused_gdn_gating(A_log, a, b, dt_bias)

    @torch.library.custom_op("sgl_kernel::fused_sigmoid_gating_delta_rule_update_cpu",
                             mutates_args=("initial_state_source", "intermediate_states_buffer"))
    def fused_sigmoid_gating_delta_rule_update_cpu(
        A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        a: torch.Tensor, b: torch.Tensor, initial_state_source: torch.Tensor,
        initial_state_indices: torch.Tensor, cu_seqlens: torch.Tensor, use_qk_l2norm_in_kernel: bool,
        softplus_beta: float = 1.0, softplus_threshold: float = 20.0, is_kda: bool = False,
        disable_state_update: bool = False, intermediate_states_buffer: torch.Tensor | None = None,
        intermediate_state_indices: torch.Tensor | None = None, cache_steps: int | None = None,
        retrieve_parent_token: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if is_kda:
            raise NotImplementedError("fused_sigmoid_gating_delta_rule_update_cpu: KDA is not supported")
        return _ops.fused_sigmoid_gating_delta_rule_update(
            A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens,
            use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold,
            disable_state_update=disable_state_update, intermediate_states_buffer=intermediate_states_buffer,
            intermediate_state_indices=intermediate_state_indices, retrieve_parent_token=retrieve_parent_token)


_register()
