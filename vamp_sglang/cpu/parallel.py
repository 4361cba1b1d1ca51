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
- DP attention with EP: `GroupCoordinator.reduce_scatterv` and `all_gatherv`
  (distributed/parallel_state.py:1253-1287, 1441-1509) run only on pynccl, which CPU mode makes unloadable
  (`SGLANG_NCCL_SO_PATH`, see `vamp_sglang.cpu`). Without NCCL, `reduce_scatterv` takes SGLang's own
  `_deterministic_reduce_scatterv` (an all-reduce, then this rank's rows: :1226-1251) and `all_gatherv` a
  gloo `all_gather` of rows padded to the largest rank's count, each rank's block then cut to its size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from vamp_sglang.integration.hooks import Hook


def moe_forward_native_skipping_other_ranks(original, layer: Any, x: torch.Tensor, topk_output: Any,
                                            moe_runner_config: Any) -> torch.Tensor:
    """Around `moe_forward_native`: the experts of this rank only; a -1 id (another rank's expert) adds nothing.

    Each top-k slot is one call of SGLang's function with k = 1 on the tokens whose slot names a local
    expert, weighted by the slot's routing weight there; the slots' outputs are summed in the weights'
    dtype, as SGLang sums a token's slots."""
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


def _without_nccl(group: Any) -> bool:
    """Whether this GroupCoordinator has no working NCCL communicator (CPU mode: the library cannot load)."""
    comm = getattr(group, "pynccl_comm", None)
    return comm is None or not getattr(comm, "available", False)


def reduce_scatterv(original, group: Any, input_: torch.Tensor, output: torch.Tensor | None = None,
                    sizes: list[int] | None = None) -> torch.Tensor:
    """Around `GroupCoordinator.reduce_scatterv`: SGLang's all-reduce-and-narrow variant where NCCL is missing."""
    if _without_nccl(group):
        return group._deterministic_reduce_scatterv(input_, output, sizes)
    return original(group, input_, output, sizes)


def all_gatherv(original, group: Any, input_: torch.Tensor | list[torch.Tensor], sizes: list[int] | None = None,
                output: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Around `GroupCoordinator.all_gatherv`: over gloo where NCCL is missing, returning what SGLang returns
    (one gathered tensor per input, in a list; `output`, for a single tensor, is written in place)."""
    if not _without_nccl(group):
        return original(group, input_, sizes, output)
    single = isinstance(input_, torch.Tensor)
    if not single and output is not None:
        raise ValueError("all_gatherv `output` requires a single-tensor input")
    inputs = [input_] if single else list(input_)
    return [gather_rows(group.device_group, group.world_size, group.rank_in_group, t, sizes,
                        output if single else None) for t in inputs]


def gather_rows(device_group: Any, world_size: int, rank: int, tensor: torch.Tensor, sizes: list[int] | None,
                output: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's rows of `tensor` (rank r holds sizes[r] rows; None: all alike), concatenated in rank
    order: one `all_gather` of blocks padded to the largest size, each block then cut to its rank's size."""
    sizes = [tensor.shape[0]] * world_size if sizes is None else [int(s) for s in sizes]
    if len(sizes) != world_size or tensor.shape[0] != sizes[rank]:
        raise ValueError(f"all_gatherv: sizes {sizes} do not fit {world_size} ranks with {tensor.shape[0]} rows "
                         f"on rank {rank}")
    most = max(sizes)
    padded = tensor.new_zeros((most, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    blocks = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(blocks, padded, group=device_group)
    gathered = torch.cat([block[:n] for block, n in zip(blocks, sizes, strict=True)])
    if output is None:
        return gathered
    if tuple(output.shape) != tuple(gathered.shape):
        raise ValueError(f"all_gatherv output buffer shape {tuple(output.shape)} != {tuple(gathered.shape)}")
    output.copy_(gathered)
    return output


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
