"""Qwen3-Next (`--arch qwen3_next`), the paper's model, scaled down; SGLang's Qwen3NextForCausalLM.

8 layers, full attention every 4th (layers 3 and 7, query-gated, partial RoPE), Gated DeltaNet linear
attention in the others with the real model's head ratio (2 key heads, 4 value heads, head dims 64,
conv kernel 4; the real one has 16/32 heads of 128), the same 128 experts of 256 as the default plus a
shared expert of 256 behind a sigmoid gate. Experts hold 96 MiB per layer; KV is 2 KiB per token (two
attention layers), and each request's linear-attention state is 6 layers x (64 KiB recurrent + 6 KiB
conv), float32. `vamp_sglang.tiny_next_reference` is a plain-torch forward of these checkpoints.

Its multi-token-prediction (MTP) layer, the draft of `--speculative-algorithm NEXTN|EAGLE`, is in its own file
(`mtp.safetensors`; transformers' Qwen3NextForCausalLM has no such layer): `mtp.fc` over
[pre_fc_norm_embedding(embed(token)); pre_fc_norm_hidden(target hidden)], one full-attention decoder layer
`mtp.layers.0` (query-gated attention, the routed and shared experts) and `mtp.norm`; embeddings and head are
the target's. SGLang's Qwen3NextForCausalLMMTP (models/qwen3_next_mtp.py:57-78) loads them by renaming `mtp.fc`
and the two pre-fc norms to its own attributes and every other `mtp.` to `model.` (models/qwen3_next.py:1173-1184).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vamp_sglang.tiny_moe.common import FLOAT32_BYTES
from vamp_sglang.tiny_moe.deepseek import MTP_WEIGHTS
from vamp_sglang.tiny_moe.qwen3_moe import Qwen3MoeSpec

# Qwen3-Next's RMSNorms scale by (1 + weight) (SGLang's GemmaRMSNorm), so their neutral weight is 0;
# the gated norm inside linear attention scales by weight.
_UNIT_NORM_AT_ZERO = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
                      "q_norm.weight", "k_norm.weight", "mtp.norm.weight", "pre_fc_norm_embedding.weight",
                      "pre_fc_norm_hidden.weight")
A_RANGE = (0.05, 1.0)  # decay rate exp(A_log): state kept over a few tokens, not forgotten at once


@dataclass(frozen=True)
class Qwen3NextSpec(Qwen3MoeSpec):
    """Qwen3-MoE's attention and experts, with linear attention between and a shared expert in every layer."""

    arch: ClassVar[str] = "qwen3_next"
    architecture: ClassVar[str] = "Qwen3NextForCausalLM"
    config_class: ClassVar[str] = "Qwen3NextConfig"

    mtp_layers: ClassVar[int] = 1  # SGLang's Qwen3-Next MTP draft is one layer (configs/model_config.py:1134-1136)

    layers: int = 8
    full_attention_interval: int = 4  # layer i has full attention iff (i + 1) % interval == 0
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_head_dim: int = 64  # key and value head dim of the linear-attention layers
    conv_kernel: int = 4
    shared_intermediate: int = 256  # the shared expert's FFN width

    def checks(self) -> list[tuple[bool, str]]:
        """An attention layer within the model, value heads grouped over key heads, a real conv."""
        s = self
        return super().checks() + [
            (1 <= s.full_attention_interval <= s.layers,
             f"full_attention_interval={s.full_attention_interval} must be in [1, layers={s.layers}]"),
            (s.linear_key_heads >= 1 and s.linear_value_heads % s.linear_key_heads == 0,
             f"linear_value_heads={s.linear_value_heads} must be a multiple of linear_key_heads"),
            (s.linear_head_dim >= 2, f"linear_head_dim={s.linear_head_dim} must be >= 2"),
            (s.conv_kernel >= 2, f"conv_kernel={s.conv_kernel} must be >= 2"),
            (s.shared_intermediate >= 1, f"shared_intermediate={s.shared_intermediate} must be >= 1"),
        ]

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Every full_attention_interval-th layer; the others hold linear-attention state, not KV."""
        return tuple(i for i in range(self.layers) if (i + 1) % self.full_attention_interval == 0)

    @property
    def linear_state_bytes(self) -> int:
        """One request's linear-attention state (recurrent [HV, V, K] and conv [D, W-1] per layer), float32."""
        heads_v, dim = self.linear_value_heads, self.linear_head_dim
        conv_dim = (2 * self.linear_key_heads + heads_v) * dim
        per_layer = heads_v * dim * dim + conv_dim * (self.conv_kernel - 1)
        return (self.layers - len(self.attention_layers)) * per_layer * FLOAT32_BYTES

    def layer_shapes(self, p: str, layer: int) -> dict[str, tuple[int, ...]]:
        """The token mixer and the shared expert, in the hub layout SGLang's loader maps."""
        h, shared = self.hidden, self.shared_intermediate
        if layer in self.attention_layers:  # q_proj carries the output gate next to each head's query
            shapes = self.attention_shapes(p, query_rows=self.heads * self.head_dim * 2)
        else:
            shapes = self._linear_attention_shapes(p)
        return shapes | {
            f"{p}.mlp.shared_expert_gate.weight": (1, h),
            f"{p}.mlp.shared_expert.gate_proj.weight": (shared, h),
            f"{p}.mlp.shared_expert.up_proj.weight": (shared, h),
            f"{p}.mlp.shared_expert.down_proj.weight": (h, shared),
        }

    def side_files(self, vocab_size: int) -> dict[str, dict[str, tuple[int, ...]]]:
        """The MTP layer (unquantised checkpoints): the names of the first full-attention layer at `mtp.layers.0`
        (its own draws; SGLang's MTP model builds its one layer as attention, full_attention_interval 1), the
        fc over [embedding; hidden] and its two input norms, and the final norm."""
        if "mtp_layers" not in self.as_manifest():
            return {}
        h, first = self.hidden, f"model.layers.{self.attention_layers[0]}."
        shapes = {"mtp.layers.0." + name.removeprefix(first): shape
                  for name, shape in self.tensor_shapes(vocab_size).items() if name.startswith(first)}
        return {MTP_WEIGHTS: shapes | {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                                       "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}}

    def _linear_attention_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        """Gated DeltaNet: fused q/k/v/z and b/a projections, a depthwise causal conv, decay and output."""
        h = self.hidden
        key = self.linear_key_heads * self.linear_head_dim
        value = self.linear_value_heads * self.linear_head_dim
        return {
            f"{p}.linear_attn.in_proj_qkvz.weight": (2 * key + 2 * value, h),
            f"{p}.linear_attn.in_proj_ba.weight": (2 * self.linear_value_heads, h),
            f"{p}.linear_attn.conv1d.weight": (2 * key + value, 1, self.conv_kernel),
            f"{p}.linear_attn.dt_bias": (self.linear_value_heads,),
            f"{p}.linear_attn.A_log": (self.linear_value_heads,),
            f"{p}.linear_attn.norm.weight": (self.linear_head_dim,),
            f"{p}.linear_attn.out_proj.weight": (h, value),
        }

    def draw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Neutral (1 + weight) norms and Gated DeltaNet's decay parameters; the rest as every family."""
        if name.endswith(_UNIT_NORM_AT_ZERO):
            return torch.zeros(shape, dtype=torch.float32)
        if name.endswith("dt_bias"):
            return torch.ones(shape, dtype=torch.float32)  # as transformers initialises it
        if name.endswith("A_log"):
            return torch.empty(shape).uniform_(*A_RANGE, generator=self.generator(name)).log()
        return super().draw(name, shape)

    def config_fields(self, vocab_size: int, eos_id: int, pad_id: int) -> dict:
        """The layer types, linear-attention heads and shared expert; RoPE on a quarter of each head."""
        return super().config_fields(vocab_size, eos_id, pad_id) | {
            "shared_expert_intermediate_size": self.shared_intermediate,
            "layer_types": ["full_attention" if i in self.attention_layers else "linear_attention"
                            for i in range(self.layers)],
            "linear_num_key_heads": self.linear_key_heads,
            "linear_num_value_heads": self.linear_value_heads,
            "linear_key_head_dim": self.linear_head_dim,
            "linear_value_head_dim": self.linear_head_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
            "partial_rotary_factor": 0.25,
        }

    def model_config(self, vocab_size: int, eos_id: int, pad_id: int):
        """SGLang's own Qwen3NextConfig needs these top-level keys, which transformers 5 does not save."""
        config = super().model_config(vocab_size, eos_id, pad_id)
        config.full_attention_interval = self.full_attention_interval
        config.rope_theta = config.rope_parameters["rope_theta"]
        return config

    def as_manifest(self) -> dict:
        """With the MTP layer's count where one is written, so a checkpoint written before it is redone."""
        written = self.mtp_layers if self.quant == "none" else 0
        return super().as_manifest() | ({"mtp_layers": written} if written else {})

    def manifest_extras(self) -> dict[str, int]:
        """The per-request linear-attention state: memory that is neither KV nor experts."""
        return {"linear_state_bytes": self.linear_state_bytes}
