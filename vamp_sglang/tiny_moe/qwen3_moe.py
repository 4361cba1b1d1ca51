"""Qwen3-MoE (`--arch qwen3_moe`, the default), SGLang's Qwen3MoeForCausalLM: attention in every layer,
with Qwen3's per-head RMSNorm on queries and keys, then the routed experts; no shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vamp_sglang.tiny_moe.common import TinyMoeSpec


@dataclass(frozen=True)
class Qwen3MoeSpec(TinyMoeSpec):
    """The common geometry as Qwen3-MoE lays it out; Qwen3-Next extends it."""

    arch: ClassVar[str] = "qwen3_moe"
    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    config_class: ClassVar[str] = "Qwen3MoeConfig"

    def attention_shapes(self, p: str, query_rows: int | None = None) -> dict[str, tuple[int, ...]]:
        """Attention with q_norm and k_norm, one weight of head_dim each."""
        return super().attention_shapes(p, query_rows) | {
            f"{p}.self_attn.q_norm.weight": (self.head_dim,),
            f"{p}.self_attn.k_norm.weight": (self.head_dim,),
        }

    def config_fields(self, vocab_size: int, eos_id: int, pad_id: int) -> dict:
        """Every layer MoE (no dense layers), top-k weights renormalised as Qwen3 does."""
        return super().config_fields(vocab_size, eos_id, pad_id) | {
            "num_experts": self.experts,
            "moe_intermediate_size": self.intermediate,
            "intermediate_size": self.intermediate,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
