"""Block-FP8 arithmetic: the dequantisation both the tiny FP8 checkpoint and the CPU FP8 ops rely on.

A block-quantised weight [N, K] is float8_e4m3fn with one float32 `weight_scale_inv` per
block_size block (DeepSeek-V3's and Qwen3-FP8's 128x128); the weight it stands for is value x scale.
"""

from __future__ import annotations

import torch

BLOCK = 128  # weight_block_size [128, 128] of the real checkpoints


def dequantise(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """q x scale_inv per block, in `dtype` (blocks at the edges may be partial)."""
    rows, cols = q.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (q.float() * scale[..., :rows, :cols]).to(dtype)
