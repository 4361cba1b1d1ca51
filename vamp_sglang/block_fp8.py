"""Block-FP8 arithmetic: the dequantisation both the tiny FP8 checkpoint and the CPU FP8 ops rely on.

A block-quantised weight [N, K] is float8_e4m3fn with one float32 `weight_scale_inv` per
block_size block (DeepSeek-V3's and Qwen3-FP8's 128x128); the weight it stands for is value x scale.
"""

from __future__ import annotations

import torch

BLOCK = 128  # weight_block_size [128, 128] of the real checkpoints


def dequantise(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """q x scale_inv per block, in `dtype` (blocks at the edges may be partial). Whole blocks broadcast
    the scales instead of expanding them to the weight's size (the float32 copy of q is still made)."""
    rows, cols = q.shape[-2:]
    if rows % block[0] == 0 and cols % block[1] == 0:
        lead = q.shape[:-2]
        blocks = q.float().view(*lead, rows // block[0], block[0], cols // block[1], block[1])
        return (blocks * scale_inv.float()[..., :, None, :, None]).view(q.shape).to(dtype)
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (q.float() * scale[..., :rows, :cols]).to(dtype)
