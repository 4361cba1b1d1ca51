"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (`--arch glm4_moe`) scaled down; SGLang's Glm4MoeForCausalLM.

The real layout (zai-org/GLM-4.5's config): grouped-query attention with biased q/k/v projections and RoPE
on half of each head (`partial_rotary_factor` 0.5), no QK norm; the first layers dense
(`first_k_dense_replace`: 3 in GLM-4.5/4.6, 1 in Air), then every layer routes to the experts by sigmoid
scores with an `e_score_correction_bias` (`noaux_tc`, one expert group) and adds one shared expert, which
VAMP never offloads. The KV pool is SGLang's plain MHATokenToKVPool, so VAMP grows it as Qwen3-MoE's.

6 layers, the first dense, the common 128 experts of 256 (96 MiB per MoE layer, float32; 5 MoE layers) and
the common attention (4 query heads, 2 KV heads of 64: 6 KiB of KV per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vamp_sglang.tiny_moe.common import TinyMoeSpec
from vamp_sglang.tiny_moe.deepseek import CORRECTION_BIAS_STD

ROPE_THETA = 1000000.0  # GLM-4.5's rope_theta
PARTIAL_ROTARY = 0.5


@dataclass(frozen=True)
class Glm4MoeSpec(TinyMoeSpec):
    """Biased GQA with half-rotary heads, dense first layers, biased sigmoid routing, one shared expert."""

    arch: ClassVar[str] = "glm4_moe"
    architecture: ClassVar[str] = "Glm4MoeForCausalLM"
    config_class: ClassVar[str] = "Glm4MoeConfig"

    dense_layers: int = 1  # first_k_dense_replace
    dense_intermediate: int = 512  # the dense layers' FFN width (intermediate_size)
    shared_experts: int = 1  # n_shared_experts, each moe_intermediate_size wide
    routed_scaling: float = 2.5  # GLM-4.5's routed_scaling_factor

    def checks(self) -> list[tuple[bool, str]]:
        s = self
        return super().checks() + [
            (0 <= s.dense_layers < s.layers,
             f"dense_layers={s.dense_layers} must be in [0, layers={s.layers})"),
            (s.shared_experts >= 1, f"shared_experts={s.shared_experts} must be >= 1"),
            (s.head_dim % 4 == 0, f"head_dim={s.head_dim} must be a multiple of 4 (RoPE on half of it)"),
        ]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.dense_layers, self.layers))

    def tensor_shapes(self, vocab_size: int) -> dict[str, tuple[int, ...]]:
        """The common layout, with the dense layers' experts replaced by one MLP."""
        shapes = super().tensor_shapes(vocab_size)
        h, dense = self.hidden, self.dense_intermediate
        for layer in range(self.dense_layers):
            p = f"model.layers.{layer}.mlp."
            shapes = {name: shape for name, shape in shapes.items() if not name.startswith(p)}
            shapes |= {f"{p}gate_proj.weight": (dense, h), f"{p}up_proj.weight": (dense, h),
                       f"{p}down_proj.weight": (h, dense)}
        return shapes

    def layer_shapes(self, p: str, layer: int) -> dict[str, tuple[int, ...]]:
        """Attention with q/k/v biases; in MoE layers the shared expert and the router's correction bias."""
        a, d = f"{p}.self_attn", self.head_dim
        shapes = self.attention_shapes(p) | {f"{a}.q_proj.bias": (self.heads * d,),
                                             f"{a}.k_proj.bias": (self.kv_heads * d,),
                                             f"{a}.v_proj.bias": (self.kv_heads * d,)}
        if layer in self.moe_layers:
            h, shared = self.hidden, self.intermediate * self.shared_experts
            shapes |= {f"{p}.mlp.shared_experts.gate_proj.weight": (shared, h),
                       f"{p}.mlp.shared_experts.up_proj.weight": (shared, h),
                       f"{p}.mlp.shared_experts.down_proj.weight": (h, shared),
                       f"{p}.mlp.gate.e_score_correction_bias": (self.experts,)}
        return shapes

    def draw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Biases small next to their projections' unit-scale outputs; the rest as every family."""
        if name.endswith(("e_score_correction_bias", "_proj.bias")):
            noise = torch.randn(shape, generator=self.generator(name), dtype=torch.float32)
            return noise * CORRECTION_BIAS_STD
        return super().draw(name, shape)

    def config_fields(self, vocab_size: int, eos_id: int, pad_id: int) -> dict:
        return super().config_fields(vocab_size, eos_id, pad_id) | {
            "n_routed_experts": self.experts,
            "n_shared_experts": self.shared_experts,
            "moe_intermediate_size": self.intermediate,
            "intermediate_size": self.dense_intermediate,
            "first_k_dense_replace": self.dense_layers,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling,
            "attention_bias": True,
            "use_qk_norm": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                                "partial_rotary_factor": PARTIAL_ROTARY},
        }

    def model_config(self, vocab_size: int, eos_id: int, pad_id: int):
        """SGLang reads the top-level `rope_theta` and `partial_rotary_factor`, which transformers 5 folds
        into `rope_parameters`."""
        config = super().model_config(vocab_size, eos_id, pad_id)
        config.rope_theta = ROPE_THETA
        config.partial_rotary_factor = PARTIAL_ROTARY
        return config

    def manifest_extras(self) -> dict[str, int]:
        return {"moe_layers": len(self.moe_layers)}
