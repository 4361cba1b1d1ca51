"""DeepSeek-V3 (`--arch deepseek_v3`) and DeepSeek-V2 (`--arch deepseek_v2`) scaled down: MLA attention.

SGLang's DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (models/deepseek_v2.py). Each layer's attention is
Multi-head Latent Attention: keys and values are projected down to one latent of `kv_lora_rank` plus one
shared RoPE key of `qk_rope_head_dim`, which is all the KV cache holds (SGLang's `MLATokenToKVPool`, one
`[rows, 1, kv_lora_rank + qk_rope_head_dim]` buffer per layer), and expanded per head by `kv_b_proj`.
V3 also projects queries through a latent (`q_lora_rank`); V2 has a plain `q_proj` (`q_lora_rank` null).
The first layer is dense (`first_k_dense_replace` 1); every other layer has the routed experts plus one
shared expert, which VAMP never offloads. V3 routes by sigmoid scores with `e_score_correction_bias`
(`noaux_tc`) in groups, V2 by softmax (`greedy`). The config carries DeepSeek's yarn `rope_scaling`
with factor 1.0 (no stretch): SGLang's CPU rope needs a scaling entry (layers/rotary_embedding/factory.py)
and renames it deepseek_yarn (models/deepseek_v2.py `DeepseekV2AttentionMLA.__init__`).

V3 also has its multi-token-prediction (MTP) layer, the draft of SGLang's `--speculative-algorithm
EAGLE|NEXTN` (`num_nextn_predict_layers` 1): `model.layers.{layers}` holds `enorm`, `hnorm`, `eh_proj` (the
draft's input, eh_proj([enorm(embed(token)); hnorm(target hidden)])), `shared_head.norm` and one MoE decoder
layer, the names SGLang's NextN loader maps (models/deepseek_common/deepseek_weight_loader.py:319-334, 552-584); embeddings and
head are the target's. It sits in its own file (`mtp.safetensors`): transformers' model has no such layer.

6 layers, the common 128 experts of 256 (96 MiB per MoE layer, float32; 5 MoE layers) against 1,920 bytes
of KV per token (6 layers x 80 floats, 3x less than the default Qwen3-MoE's): the real models' trade,
experts large and MLA's KV small. `kv_heads` is not used (MLA has no grouped KV heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vamp_sglang.tiny_moe.common import TinyMoeSpec

ROPE_THETA = 10000.0
MTP_WEIGHTS = "mtp.safetensors"
CORRECTION_BIAS_STD = 0.1  # small next to sigmoid scores in (0, 1): it tilts routing, it does not decide it


@dataclass(frozen=True)
class DeepseekV3Spec(TinyMoeSpec):
    """MLA with a query latent, sigmoid group-limited routing with a correction bias, one shared expert."""

    arch: ClassVar[str] = "deepseek_v3"
    architecture: ClassVar[str] = "DeepseekV3ForCausalLM"
    config_class: ClassVar[str] = "DeepseekV3Config"

    mtp_layers: ClassVar[int] = 1  # num_nextn_predict_layers: V3's MTP draft layer (SGLang loads exactly 1)

    kv_lora_rank: int = 64
    q_lora_rank: int | None = 96
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    dense_layers: int = 1  # first_k_dense_replace
    dense_intermediate: int = 512  # the dense layers' FFN width (intermediate_size)
    shared_experts: int = 1  # n_shared_experts, each moe_intermediate_size wide
    expert_groups: int = 8  # n_group, as DeepSeek-V3 (of 256 experts)
    top_groups: int = 4  # topk_group
    routed_scaling: float = 2.5

    def checks(self) -> list[tuple[bool, str]]:
        """A MoE layer after the dense ones, whole expert groups, MLA dims that SGLang's kernels take."""
        s = self
        return super().checks() + [
            (0 <= s.dense_layers < s.layers, f"dense_layers={s.dense_layers} must be in [0, layers={s.layers})"),
            (s.kv_lora_rank >= 1 and s.v_head_dim >= 1 and s.qk_nope_head_dim >= 1,
             "kv_lora_rank, qk_nope_head_dim and v_head_dim must be >= 1"),
            (s.qk_rope_head_dim >= 2 and s.qk_rope_head_dim % 2 == 0,
             f"qk_rope_head_dim={s.qk_rope_head_dim} must be even and >= 2"),
            (s.q_lora_rank is None or s.q_lora_rank >= 1, f"q_lora_rank={s.q_lora_rank} must be >= 1 or None"),
            (s.expert_groups >= 1 and s.experts % s.expert_groups == 0,
             f"experts={s.experts} must be a multiple of expert_groups={s.expert_groups}"),
            (1 <= s.top_groups <= s.expert_groups, f"top_groups={s.top_groups} must be in [1, expert_groups]"),
            (s.shared_experts >= 1, f"shared_experts={s.shared_experts} must be >= 1"),
        ]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.dense_layers, self.layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """One latent row per layer: kv_lora_rank + qk_rope_head_dim elements (no separate V)."""
        return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.activation_bytes

    def tensor_shapes(self, vocab_size: int) -> dict[str, tuple[int, ...]]:
        """The common layout, with the dense layers' experts replaced by one MLP."""
        shapes = super().tensor_shapes(vocab_size)
        h = self.hidden
        for layer in range(self.dense_layers):
            p = f"model.layers.{layer}.mlp."
            shapes = {name: shape for name, shape in shapes.items() if not name.startswith(p)}
            shapes |= {f"{p}gate_proj.weight": (self.dense_intermediate, h),
                       f"{p}up_proj.weight": (self.dense_intermediate, h),
                       f"{p}down_proj.weight": (h, self.dense_intermediate)}
        return shapes

    def side_files(self, vocab_size: int) -> dict[str, dict[str, tuple[int, ...]]]:
        """The MTP layer (unquantised checkpoints): a copy of the first MoE layer's names at layer `layers`
        (its own draws), plus the four tensors that feed it the target's hidden state."""
        if "mtp_layers" not in self.as_manifest():
            return {}
        h, first_moe, mtp = self.hidden, f"model.layers.{self.dense_layers}.", f"model.layers.{self.layers}."
        shapes = {mtp + name.removeprefix(first_moe): shape
                  for name, shape in self.tensor_shapes(vocab_size).items() if name.startswith(first_moe)}
        shapes |= {f"{mtp}enorm.weight": (h,), f"{mtp}hnorm.weight": (h,), f"{mtp}eh_proj.weight": (h, 2 * h),
                   f"{mtp}shared_head.norm.weight": (h,)}
        return {MTP_WEIGHTS: shapes}

    def layer_shapes(self, p: str, layer: int) -> dict[str, tuple[int, ...]]:
        """MLA's projections, and in MoE layers the shared expert (and V3's correction bias)."""
        shapes = self._mla_shapes(p)
        if layer in self.moe_layers:
            h, shared = self.hidden, self.intermediate * self.shared_experts
            shapes |= {f"{p}.mlp.shared_experts.gate_proj.weight": (shared, h),
                       f"{p}.mlp.shared_experts.up_proj.weight": (shared, h),
                       f"{p}.mlp.shared_experts.down_proj.weight": (h, shared)}
            if self.noaux_tc:
                shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (self.experts,)
        return shapes

    def _mla_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        h, heads, a = self.hidden, self.heads, f"{p}.self_attn"
        q_rows = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank is None:
            query = {f"{a}.q_proj.weight": (q_rows, h)}
        else:
            query = {f"{a}.q_a_proj.weight": (self.q_lora_rank, h),
                     f"{a}.q_a_layernorm.weight": (self.q_lora_rank,),
                     f"{a}.q_b_proj.weight": (q_rows, self.q_lora_rank)}
        return query | {
            f"{a}.kv_a_proj_with_mqa.weight": (self.kv_lora_rank + self.qk_rope_head_dim, h),
            f"{a}.kv_a_layernorm.weight": (self.kv_lora_rank,),
            f"{a}.kv_b_proj.weight": (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            f"{a}.o_proj.weight": (h, heads * self.v_head_dim),
        }

    @property
    def noaux_tc(self) -> bool:
        return True

    def draw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("e_score_correction_bias"):
            return torch.randn(shape, generator=self.generator(name), dtype=torch.float32) * CORRECTION_BIAS_STD
        return super().draw(name, shape)

    def routing_fields(self) -> dict:
        """How the router picks experts; set on the config after construction (not every config class takes
        each of these as an argument, and SGLang reads them all)."""
        return {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": self.expert_groups,
                "topk_group": self.top_groups, "norm_topk_prob": True, "routed_scaling_factor": self.routed_scaling}

    def config_fields(self, vocab_size: int, eos_id: int, pad_id: int) -> dict:
        fields = super().config_fields(vocab_size, eos_id, pad_id)
        del fields["head_dim"]  # MLA's head dims are the four below
        return fields | {
            "num_key_value_heads": self.heads,  # MLA has no grouped KV; kv_heads is not used
            "n_routed_experts": self.experts,
            "n_shared_experts": self.shared_experts,
            "moe_intermediate_size": self.intermediate,
            "intermediate_size": self.dense_intermediate,
            "first_k_dense_replace": self.dense_layers,
            "moe_layer_freq": 1,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_parameters": self.rope_scaling | {"rope_theta": ROPE_THETA},
        }

    @property
    def rope_scaling(self) -> dict:
        """DeepSeek's yarn entry at factor 1.0: the same rotation as plain RoPE, the CPU rope's code path."""
        return {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": self.max_positions,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

    def model_config(self, vocab_size: int, eos_id: int, pad_id: int):
        """SGLang reads the top-level `rope_scaling`, `rope_theta` and `scoring_func`, which transformers 5
        folds into `rope_parameters` or drops."""
        config = super().model_config(vocab_size, eos_id, pad_id)
        config.rope_scaling = dict(self.rope_scaling)
        config.rope_theta = ROPE_THETA
        for key, value in self.routing_fields().items():
            setattr(config, key, value)
        return config

    def as_manifest(self) -> dict:
        """With the MTP layer's count where one is written, so a checkpoint written before it is redone."""
        written = self.mtp_layers if self.quant == "none" else 0
        return super().as_manifest() | ({"mtp_layers": written} if written else {})

    def manifest_extras(self) -> dict[str, int]:
        return {"moe_layers": len(self.moe_layers), "kv_cache_dim": self.kv_lora_rank + self.qk_rope_head_dim}


@dataclass(frozen=True)
class DeepseekV2Spec(DeepseekV3Spec):
    """V2: no query latent (`q_proj`), softmax top-k over all experts (`greedy`), no correction bias."""

    arch: ClassVar[str] = "deepseek_v2"
    architecture: ClassVar[str] = "DeepseekV2ForCausalLM"
    config_class: ClassVar[str] = "DeepseekV2Config"

    mtp_layers: ClassVar[int] = 0

    q_lora_rank: int | None = None
    expert_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0

    @property
    def noaux_tc(self) -> bool:
        return False

    def routing_fields(self) -> dict:
        return {"topk_method": "greedy", "scoring_func": "softmax", "n_group": self.expert_groups,
                "topk_group": self.top_groups, "norm_topk_prob": False, "routed_scaling_factor": self.routed_scaling}
