"""GroupCoordinator's variable-size collectives without NCCL (DP attention with EP on CPU; see cpu/parallel.py).

SGLang 0.5.23's `reduce_scatterv` and `all_gatherv` (distributed/parallel_state.py:1253-1287, 1441-1509) run only
on pynccl. Where no NCCL communicator works (CPU mode makes the library unloadable), `reduce_scatterv` takes
SGLang's own `_deterministic_reduce_scatterv` (an all-reduce, then this rank's rows: :1226-1251) and
`all_gatherv` one gloo `all_gather` of rows padded to the largest rank's count, each block then cut to its
rank's size. Plain torch, so a test's ranks need not import SGLang.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


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
