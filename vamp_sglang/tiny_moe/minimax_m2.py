"""MiniMax-M2 (`--arch minimax_m2`) scaled down; SGLang's MiniMaxM2ForCausalLM.

The real layout (MiniMaxAI/MiniMax-M2's config): full attention in every layer (grouped-query, no biases),
with a "per_layer" QK norm, one RMSNorm over all the heads' queries and one over all the keys together
(`q_norm` of heads x head_dim, `k_norm` of kv_heads x head_dim; under attention TP SGLang all-reduces the
variance so each rank normalises by the whole vector's), and RoPE on half of each head (`rotary_dim` 64 of
head_dim 128). Every layer routes by sigmoid scores with an `e_score_correction_bias` (`use_routing_bias`,
no expert groups, weights renormalised) to Mixtral-named experts (`block_sparse_moe`, w1/w3/w2); no
shared expert and no dense layer, so every layer's experts are VAMP's. The KV pool is SGLang's plain
MHATokenToKVPool, grown as Qwen3-MoE's. The real checkpoint ships block-FP8 and three MTP modules; this
one is float32 and carries none (`num_mtp_modules` 0).

The common geometry otherwise: 6 layers of 128 experts of 256, top-2 (96 MiB per layer, float32), 4 query
heads and 2 KV heads of 64 with RoPE on 32 of them (6 KiB of KV per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vamp_sglang.tiny_moe.deepseek import CORRECTION_BIAS_STD
from vamp_sglang.tiny_moe.mixtral import MixtralSpec

ROPE_THETA = 5000000.0  # MiniMax-M2's rope_theta
QK_NORM_WEIGHT_STD = 0.1  # QK norm weights around 1, so a weight loaded to the wrong place shows


@dataclass(frozen=True)
class MiniMaxM2Spec(MixtralSpec):
    """Mixtral's names with a whole-vector QK norm, half-rotary heads and biased sigmoid routing."""

    arch: ClassVar[str] = "minimax_m2"
    architecture: ClassVar[str] = "MiniMaxM2ForCausalLM"
    config_class: ClassVar[str] = "MiniMaxM2Config"

    def checks(self) -> list[tuple[bool, str]]:
        """Mixtral's hidden == heads x head_dim does not apply: MiniMax-M2 reads head_dim from the config."""
        return super(MixtralSpec, self).checks() + [
            (self.head_dim % 4 == 0, f"head_dim={self.head_dim} must be a multiple of 4 (RoPE on half of it)"),
        ]

    @property
    def rotary_dim(self) -> int:
        return self.head_dim // 2

    def layer_shapes(self, p: str, layer: int) -> dict[str, tuple[int, ...]]:
        """Attention with one QK-norm weight over all query heads and one over all KV heads; the router's
        correction bias beside the router."""
        return self.attention_shapes(p) | {
            f"{p}.self_attn.q_norm.weight": (self.heads * self.head_dim,),
            f"{p}.self_attn.k_norm.weight": (self.kv_heads * self.head_dim,),
            f"{p}.{self.moe}.e_score_correction_bias": (self.experts,),
        }

    def draw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """QK-norm weights near 1 and a small correction bias; the rest as every family."""
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            noise = torch.randn(shape, generator=self.generator(name), dtype=torch.float32)
            return 1.0 + noise * QK_NORM_WEIGHT_STD
        if name.endswith("e_score_correction_bias"):
            return torch.randn(shape, generator=self.generator(name), dtype=torch.float32) * CORRECTION_BIAS_STD
        return super().draw(name, shape)

    def config_fields(self, vocab_size: int, eos_id: int, pad_id: int) -> dict:
        """transformers' MiniMaxM2Config fields, and the ones only SGLang reads (the real config.json has
        them all): qk norm, routing and the MTP count."""
        return super().config_fields(vocab_size, eos_id, pad_id) | {
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                                "partial_rotary_factor": self.rotary_dim / self.head_dim},
            "rotary_dim": self.rotary_dim,
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "num_mtp_modules": 0,
        }

    def model_config(self, vocab_size: int, eos_id: int, pad_id: int):
        """SGLang reads the top-level `rope_theta`, which transformers 5 folds into `rope_parameters`."""
        config = super().model_config(vocab_size, eos_id, pad_id)
        config.rope_theta = ROPE_THETA
        return config
