"""Stand-in `sgl_kernel` for SGLang 0.5.23 on a CPU without the sgl-kernel CPU build.

PyPI ships `sglang-kernel` only as a CUDA build: importing it on a machine without libcuda fails,
and SGLang's CPU path imports it unconditionally (`if _is_cpu: from sgl_kernel import ...`).
This package, put FIRST on PYTHONPATH by `vamp_sglang.cpu.cpu_environment()` and only in CPU mode,
answers those imports:

- the two ops a CPU server calls, written in plain torch with the semantics of SGLang's Triton
  kernels (`assign_req_to_token_pool` in srt/mem_cache/allocation.py, `copy_all_layer_kv_cache_tiled`
  in kernels/ops/kvcache/cache_move.py);
- the six speculative-decoding ops (EAGLE/NEXTN drafts, `--speculative-*`), in plain torch with the
  semantics of their Triton twins (see `sgl_kernel.speculative`).

It registers under `torch.ops.sgl_kernel` only the four ops SGLang's Qwen3.5 model binds at import
(`sgl_kernel.qwen3_5`, imported here), and `sgl_kernel.mamba` (Qwen3-Next's Gated DeltaNet ops, see
there) registers only its two ops: SGLang then finds no
`convert_weight_packed`, keeps the Intel AMX backend off, and runs every layer (MoE included)
through `forward_native`. Names that SGLang imports inside `try/except ImportError` (rmsnorm,
`sgl_kernel.scalar_type`, `sgl_kernel.allreduce`) are left out on purpose so its fallbacks run.
The import list was taken from SGLang 0.5.23 (tests/test_cpu_mode.py checks it); re-check it when
upgrading SGLang.
"""

from __future__ import annotations

import ctypes

import torch

from . import qwen3_5  # noqa: F401  registers Qwen3.5's four torch ops
from .speculative import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)

__version__ = "0.0.0+vamp.cpu.shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the req->token table.

    Request i gets out_cache_loc[sum of earlier lengths : + its length] at columns
    [start_offset[i], end_offset[i]) of row req_pool_indices[i] (rows are pool_len long).
    """
    flat = req_to_token.view(-1)
    consumed = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        length = end - start
        base = row * pool_len + start
        flat[base:base + length] = out_cache_loc[consumed:consumed + length].to(flat.dtype)
        consumed += length


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV slots src_loc -> tgt_loc in every layer buffer (K and V of all layers).

    The pool hands over raw addresses (`data_ptrs`, uint64) and row strides in bytes, so each
    buffer is viewed through ctypes as rows of bytes; rows past max(loc) are never touched.
    """
    if tgt_loc.numel() == 0:
        return
    rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    for address, stride_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride_bytes)).from_address(address)
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride_bytes)
        buffer[tgt_loc] = buffer[src_loc]


_SPECULATIVE = (assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu,
                build_tree_kernel_efficient_cpu, fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu,
                verify_tree_greedy_cpu)
for _op in _SPECULATIVE:
    _op.__module__ = __name__  # sgl_kernel's own ops, as the real package exports them
SPECULATIVE_OPS = tuple(op.__name__ for op in _SPECULATIVE)

IMPLEMENTED_OPS = ("assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", *SPECULATIVE_OPS)
UNSUPPORTED_OPS: tuple[str, ...] = ()  # every op SGLang 0.5.23's CPU path imports is implemented
