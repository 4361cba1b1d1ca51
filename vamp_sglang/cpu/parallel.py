"""Expert parallelism, DP attention and their mix on SGLang 0.5.23's CPU path: the three gaps CPU mode fills.

Measured on the tiny Qwen3-MoE and DeepSeek-V3 (shared research `deploy-modes.md`, section 3 and appendix B);
each gap stops a CPU server at its first forward, and each hook is placed in CPU mode only (GPUs keep SGLang's
own paths):
- EP (`--ep-size` > 1, standard dispatcher): the dispatcher maps other ranks' experts to -1
  (layers/moe/token_dispatcher/standard.py:94-102, 253-262), and SGLang's native MoE, the CPU kernel without
  Intel AMX, counts tokens per expert with `cnts.scatter_(1, topk_ids, 1)` (layers/moe/fused_moe_native.py:77),
  which a -1 stops. `moe_forward_native_skipping_other_ranks` runs SGLang's own function once per top-k
  slot on the tokens whose slot names a local expert and adds the results: a token's slot then names one
  expert, which the per-expert count assumes (scatter_ sets, it does not add), and skipped slots add nothing.
  Without a -1 the original runs unchanged.
- DP attention: padding a batch for the MLP sync asks the attention backend for
  `get_cpu_graph_seq_len_fill_value()` on CPU (model_executor/forward_batch_info.py:2013-2017); only Intel
  AMX's backend has it (layers/attention/intel_amx_backend.py:198-199, returning 1). `TorchNativeWithFill`
  is torch_native with the same answer; it replaces the class where the attention registry imports it
  (layers/attention/attention_registry.py:219).
- DP attention with EP: `GroupCoordinator.reduce_scatterv` and `all_gatherv` run only on pynccl, which CPU
  mode makes unloadable (`SGLANG_NCCL_SO_PATH`, see `vamp_sglang.cpu`); cpu/gathers.py answers them over gloo.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from vamp_sglang.cpu.gathers import all_gatherv, reduce_scatterv
from vamp_sglang.integration.hooks import Hook


def moe_forward_native_skipping_other_ranks(original, layer: Any, x: torch.Tensor, topk_output: Any,
                                            moe_runner_config: Any) -> torch.Tensor:
    """Around `moe_forward_native`: the experts of this rank only; a -1 id (another rank's expert) adds nothing.

    Each top-k slot is one call of SGLang's function with k = 1 on the tokens whose slot names a local
    expert, weighted by the slot's routing weight there; the slots' outputs are summed in the weights'
    dtype. Each call returns x's dtype, so under bf16 every slot is rounded before the sum, where SGLang
    rounds once after it: exact in float32 (the tests' dtype), within bf16 rounding otherwise."""
    topk_weights, topk_ids = topk_output[0], topk_output[1]
    if not bool((topk_ids < 0).any()):
        return original(layer, x, topk_output, moe_runner_config)
    out = torch.zeros(x.shape, dtype=topk_weights.dtype, device=x.device)  # w2 maps back to the hidden size
    for slot in range(topk_ids.shape[1]):
        tokens = torch.nonzero(topk_ids[:, slot] >= 0).flatten()
        if tokens.numel() == 0:
            continue
        one = (topk_weights[tokens, slot:slot + 1], topk_ids[tokens, slot:slot + 1], None)
        out.index_add_(0, tokens, original(layer, x[tokens], one, moe_runner_config).to(out.dtype))
    return out.to(x.dtype)


class TorchNativeWithFill(TorchNativeAttnBackend):
    """torch_native with the fill value DP attention's batch padding asks a CPU backend for."""

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        """A padded request's sequence length: 1, as Intel AMX's backend answers (intel_amx_backend.py:198)."""
        return 1


_GROUP = "sglang.srt.distributed.parallel_state.GroupCoordinator"
HOOKS = [
    Hook("sglang.srt.layers.moe.fused_moe_native.moe_forward_native", "around",
         moe_forward_native_skipping_other_ranks,
         "CPU mode, expert parallelism: SGLang's native MoE skips other ranks' experts (-1 ids), which stop "
         "its per-expert count"),
    Hook("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend", "replace", TorchNativeWithFill,
         "CPU mode, DP attention: torch_native answers the padded sequence length (1, as Intel AMX) that a "
         "CPU batch's MLP-sync padding asks for"),
    Hook(f"{_GROUP}.reduce_scatterv", "around", reduce_scatterv,
         "CPU mode, DP attention with EP: without NCCL, SGLang's own all-reduce-and-narrow reduce_scatterv"),
    Hook(f"{_GROUP}.all_gatherv", "around", all_gatherv,
         "CPU mode, DP attention with EP: without NCCL, a gloo all_gather of rows padded to the largest rank's"),
]
