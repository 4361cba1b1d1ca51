"""Qwen3.5 / Qwen3.6 MoE (`--arch qwen3_5_moe`) scaled down, text only; SGLang's Qwen3_5MoeForCausalLM.

The real models (Qwen3.6-35B-A3B, Qwen3.5-397B-A17B) are Qwen3-Next's successors: the same hybrid of Gated
DeltaNet linear attention and query-gated full attention every 4th layer, routed experts plus one gated
shared expert in every layer, (1 + weight) RMSNorms. What changes on the checkpoint side is the linear
attention's projections: Qwen3.5 ships q/k/v, z, b and a as four separate tensors (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`) laid out head-contiguous, where Qwen3-Next interleaves them per key
head in two fused ones; SGLang merges them into `in_proj_qkvz` / `in_proj_ba` at load and splits them back
per step (on CPU with `fused_qkvzba_split_reshape_cat_contiguous_cpu`). The published checkpoints wrap this
text model in a vision-language class (`Qwen3_5MoeForConditionalGeneration`); SGLang registers the text
model on its own (models/qwen3_5_text.py), which is what this checkpoint names, with transformers'
`Qwen3_5MoeTextConfig` (model_type `qwen3_5_moe_text`) and `Qwen3_5MoeForCausalLM` as the reference.

Qwen3-Next's tiny geometry otherwise (8 layers, attention at 3 and 7, 2 key and 4 value heads of 64, 128
experts of 256 top-2, a shared expert of 256): 96 MiB of experts per layer, 2 KiB of KV per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vamp_sglang.tiny_moe.qwen3_next import Qwen3NextSpec


@dataclass(frozen=True)
class Qwen3_5MoeSpec(Qwen3NextSpec):
    """Qwen3-Next's layers with Qwen3.5's separate, head-contiguous linear-attention projections."""

    arch: ClassVar[str] = "qwen3_5_moe"
    architecture: ClassVar[str] = "Qwen3_5MoeForCausalLM"
    config_class: ClassVar[str] = "Qwen3_5MoeTextConfig"

    def _linear_attention_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        """q/k/v, z, b and a as four projections; conv, decay, gated norm and output as Qwen3-Next's."""
        fused = super()._linear_attention_shapes(p)
        a, h = f"{p}.linear_attn", self.hidden
        key = self.linear_key_heads * self.linear_head_dim
        value = self.linear_value_heads * self.linear_head_dim
        del fused[f"{a}.in_proj_qkvz.weight"], fused[f"{a}.in_proj_ba.weight"]
        return fused | {
            f"{a}.in_proj_qkv.weight": (2 * key + value, h),
            f"{a}.in_proj_z.weight": (value, h),
            f"{a}.in_proj_b.weight": (self.linear_value_heads, h),
            f"{a}.in_proj_a.weight": (self.linear_value_heads, h),
        }
