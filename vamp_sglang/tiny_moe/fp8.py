"""`--quant fp8`: the layout of the FP8 checkpoints users deploy (Qwen3-30B-A3B-FP8, DeepSeek-V3).

Block-quantised W8A8: every attention and expert projection is stored as float8_e4m3fn with one float32
`weight_scale_inv` per 128x128 block (dequantised weight = fp8 value x scale), and config.json carries
Qwen3-30B-A3B-FP8's `quantization_config`, which makes SGLang build `Fp8LinearMethod` and `Fp8MoEMethod`
(layers/quantization/fp8.py:396-410). Embeddings, lm_head, norms and the router gate stay bfloat16, as
in the real checkpoints (the qwen3_moe gate is built without a quant config, models/qwen3_moe.py:285).

Why the scales are powers of two (as in UE8M0 checkpoints): an e4m3 value (3 mantissa bits) times 2^k
is exact in bfloat16, so the bf16 checkpoint written next to the FP8 one (`bf16/` inside it) holds the
dequantised weights exactly: the FP8 model and its bf16 source compute the same function, and a server
on each must give the same greedy tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from vamp_sglang.block_fp8 import BLOCK, dequantise

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
ACTIVATION_BYTES = 2  # bfloat16
SCALE_BYTES = 4  # one float32 weight_scale_inv per block
FP8_INTERMEDIATE = 1024  # the CLI's expert width with --quant fp8: 1 byte x 4 = float32's 4 bytes x 256
SOURCE_DIR = "bf16"  # the bf16 checkpoint the FP8 one is quantised from, inside the FP8 checkpoint
QUANTIZATION_CONFIG: dict[str, Any] = {  # Qwen3-30B-A3B-FP8's config.json, less its modules_to_not_convert
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}


def quantization_config(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """QUANTIZATION_CONFIG with the bf16 linear modules of these (unquantised) tensors listed."""
    skipped = not_converted(tensors)
    return QUANTIZATION_CONFIG | ({"modules_to_not_convert": skipped} if skipped else {})


def block_checks(spec: Any) -> list[tuple[bool, str]]:
    """Every blocked dimension a multiple of 128 (SGLang asserts it per partition, fp8.py create_weights)."""
    if spec.quant != "fp8":
        return []
    dims = {"hidden": spec.hidden, "intermediate": spec.intermediate, "heads*head_dim": spec.heads * spec.head_dim,
            "kv_heads*head_dim": spec.kv_heads * spec.head_dim}
    return [(value % BLOCK == 0, f"quant=fp8 needs {name}={value} to be a multiple of {BLOCK}")
            for name, value in dims.items()]


def stored_bytes(weight_elements: int) -> int:
    """Bytes of `weight_elements` FP8 weights with their block scales (dimensions multiples of 128)."""
    return weight_elements + weight_elements // (BLOCK * BLOCK) * SCALE_BYTES


def is_quantised(name: str, shape: tuple[int, ...]) -> bool:
    """A decoder layer's projections are FP8 when they are whole 128x128 blocks; routers, gates,
    embeddings, lm_head, norms, convolutions and odd-sized projections (Qwen3-Next's in_proj_ba) are not."""
    gate = name.endswith((".gate.weight", "shared_expert_gate.weight"))
    return (name.startswith("model.layers.") and name.endswith(".weight") and not gate and len(shape) == 2
            and all(d % BLOCK == 0 for d in shape))


def not_converted(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The linear modules of the decoder layers left in bf16, as the real checkpoints list them in
    `modules_to_not_convert`: SGLang gives FP8 to every linear layer not listed (fp8.py:396-407)."""
    return sorted(name.removesuffix(".weight") for name, t in tensors.items()
                  if name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2
                  and not is_quantised(name, tuple(t.shape)) and not name.endswith("norm.weight"))


def quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], float32 scale_inv [N/128, K/128]): per block the smallest power of two that
    brings the block's largest magnitude within e4m3's range."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


def checkpoint_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(FP8 checkpoint tensors, their bf16 source): projections quantised with a `weight_scale_inv`
    beside each, everything else bfloat16 in both."""
    quantised: dict[str, torch.Tensor] = {}
    source: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not is_quantised(name, tuple(tensor.shape)):
            quantised[name] = source[name] = tensor.to(torch.bfloat16)
            continue
        q, scale = quantise(tensor)
        quantised[name] = q
        quantised[name.removesuffix("weight") + "weight_scale_inv"] = scale
        source[name] = dequantise(q, scale, torch.bfloat16)
    return quantised, source

