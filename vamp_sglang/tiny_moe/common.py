"""What every tiny MoE family shares: the geometry and its checks, the tensors around each layer's token
mixer, how a tensor is drawn, and the config fields common to all.

The default geometry (6 layers, 128 experts, hidden 256, expert intermediate 256, float32) holds 96 MiB
of experts per layer against 6 KiB of KV per token (2 KV heads x head_dim 64), so 25% of the five
eligible layers is about 20k tokens.

Tensors are named in the Hugging Face hub layout (one tensor per expert projection), which is what both
transformers' and SGLang's loaders expect, whatever fused layout they build in memory. Every tensor is
drawn from its own generator seeded by (seed, tensor name), so the bytes do not depend on the order of
creation; the safetensors file is byte-identical for a given seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vamp_sglang.tiny_moe import fp8

QUANTS = ("none", "fp8")
LOGIT_STD = 4.0  # spread of the random logits: peaked enough that greedy decoding is not flat
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class TinyMoeSpec:
    """Geometry and seed every family shares; equal specs give byte-identical weights.

    `TinyMoeSpec()` is the default geometry. A family is a frozen subclass that names its arch and
    transformers classes and extends the hooks below (fields, checks, tensors, draws, config, manifest)
    with what its architecture adds; `checkpoint.FAMILIES` lists them.
    """

    arch: ClassVar[str]  # the CLI's --arch and the manifest's spec.arch
    architecture: ClassVar[str]  # the config's `architectures` entry, which picks SGLang's model class
    config_class: ClassVar[str]  # the transformers config class, imported only when a checkpoint is written
    moe: ClassVar[str] = "mlp"  # the module holding router and experts
    expert_projections: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down

    seed: int = 0
    layers: int = 6
    experts: int = 128
    top_k: int = 2
    hidden: int = 256
    intermediate: int = 256  # per-expert FFN width
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 2048  # BPE target; the model's vocab is the tokenizer's actual size
    max_positions: int = 16384
    quant: str = "none"  # "fp8": block-quantised W8A8 linear weights in the layout of real FP8 checkpoints (fp8.py)

    def checks(self) -> list[tuple[bool, str]]:
        """(holds, message) per constraint, in the order `validate` reports them; families append theirs."""
        s = self
        return [
            (s.seed >= 0, f"seed={s.seed} must be >= 0"),
            (s.layers >= 1, f"layers={s.layers} must be >= 1"),
            (s.experts >= 1, f"experts={s.experts} must be >= 1"),
            (1 <= s.top_k <= s.experts, f"top_k={s.top_k} must be in [1, experts={s.experts}]"),
            (s.hidden >= 8, f"hidden={s.hidden} must be >= 8"),
            (s.intermediate >= 1, f"intermediate={s.intermediate} must be >= 1"),
            (s.kv_heads >= 1, f"kv_heads={s.kv_heads} must be >= 1"),
            (s.heads >= 1 and s.kv_heads >= 1 and s.heads % s.kv_heads == 0,
             f"heads={s.heads} must be a positive multiple of kv_heads={s.kv_heads}"),
            (s.head_dim >= 2 and s.head_dim % 2 == 0, f"head_dim={s.head_dim} must be even and >= 2"),
            (s.vocab >= 512, f"vocab={s.vocab} must be >= 512"),
            (s.max_positions >= 128, f"max_positions={s.max_positions} must be >= 128"),
            (s.quant in QUANTS, f"quant={s.quant!r} must be one of {', '.join(QUANTS)}"),
            *fp8.block_checks(s),
        ]

    def validate(self) -> TinyMoeSpec:
        """self, or a ValueError naming the first field that breaks a check."""
        for ok, message in self.checks():
            if not ok:
                raise ValueError(message)
        return self

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with a KV cache: all of them, unless a family mixes in another token mixer."""
        return tuple(range(self.layers))

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of activations and KV: float32, or bfloat16 for FP8 (SGLang's Fp8Config
        takes bf16/fp16 activations only, quantization/fp8.py:326)."""
        return fp8.ACTIVATION_BYTES if self.quant == "fp8" else FLOAT32_BYTES

    @property
    def expert_bytes_per_layer(self) -> int:
        """gate, up and down projections of every expert in one layer: float32, or FP8 plus block scales."""
        weights = self.experts * 3 * self.hidden * self.intermediate
        return fp8.stored_bytes(weights) if self.quant == "fp8" else weights * FLOAT32_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every attention layer for one token (what one KV pool slot costs)."""
        return len(self.attention_layers) * 2 * self.kv_heads * self.head_dim * self.activation_bytes

    def tensor_shapes(self, vocab_size: int) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint in hub layout, name -> shape."""
        h, i = self.hidden, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (vocab_size, h),
            "model.norm.weight": (h,),
            "lm_head.weight": (vocab_size, h),
        }
        gate, up, down = self.expert_projections
        for layer in range(self.layers):
            p = f"model.layers.{layer}"
            shapes[f"{p}.input_layernorm.weight"] = (h,)
            shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
            shapes |= self.layer_shapes(p, layer)
            shapes[f"{p}.{self.moe}.gate.weight"] = (self.experts, h)
            for e in range(self.experts):
                shapes[f"{p}.{self.moe}.experts.{e}.{gate}.weight"] = (i, h)
                shapes[f"{p}.{self.moe}.experts.{e}.{up}.weight"] = (i, h)
                shapes[f"{p}.{self.moe}.experts.{e}.{down}.weight"] = (h, i)
        return shapes

    def side_files(self, vocab_size: int) -> dict[str, dict[str, tuple[int, ...]]]:
        """Weights SGLang loads and transformers does not (a draft layer), file name -> {name: shape}: kept
        out of the main file, whose transformers load reports no unexpected keys. None by default."""
        return {}

    def layer_shapes(self, p: str, layer: int) -> dict[str, tuple[int, ...]]:
        """Layer `layer`'s token mixer and whatever else the family adds besides norms, router and experts."""
        return self.attention_shapes(p)

    def attention_shapes(self, p: str, query_rows: int | None = None) -> dict[str, tuple[int, ...]]:
        """Plain multi-head attention with grouped KV; query_rows when q_proj carries more than queries."""
        h, d = self.hidden, self.head_dim
        return {
            f"{p}.self_attn.q_proj.weight": (self.heads * d if query_rows is None else query_rows, h),
            f"{p}.self_attn.k_proj.weight": (self.kv_heads * d, h),
            f"{p}.self_attn.v_proj.weight": (self.kv_heads * d, h),
            f"{p}.self_attn.o_proj.weight": (h, self.heads * d),
        }

    def generator(self, name: str) -> torch.Generator:
        """A generator keyed by (seed, name), so a tensor's bytes do not depend on the order of creation."""
        key = int.from_bytes(hashlib.sha256(f"{self.seed}/{name}".encode()).digest()[:8], "little")
        return torch.Generator().manual_seed(key & (2**63 - 1))

    def draw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """One tensor: norms neutral, projections random at a scale that keeps activations near unit."""
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.float32)
        generator = self.generator(name)
        if name == "model.embed_tokens.weight":
            std = 1.0
        elif name == "lm_head.weight":
            std = LOGIT_STD / math.sqrt(shape[1])  # the final RMSNorm gives unit-RMS inputs
        else:
            std = 1.0 / math.sqrt(math.prod(shape[1:]))  # keep every projection's output near unit scale
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    def config_fields(self, vocab_size: int, eos_id: int, pad_id: int) -> dict:
        """Keyword arguments of the transformers config: those every family takes; families add theirs."""
        return {
            "vocab_size": vocab_size,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_experts_per_tok": self.top_k,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "bos_token_id": None,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "dtype": "bfloat16" if self.quant == "fp8" else "float32",
        }

    def model_config(self, vocab_size: int, eos_id: int, pad_id: int):
        """The transformers config that both transformers and SGLang read."""
        import transformers

        config = getattr(transformers, self.config_class)(**self.config_fields(vocab_size, eos_id, pad_id))
        config.architectures = [self.architecture]
        return config

    def as_manifest(self) -> dict:
        """The spec as the manifest records it: arch and every field (equal records mean equal bytes)."""
        return {"arch": self.arch} | dataclasses.asdict(self)

    def manifest_extras(self) -> dict[str, int]:
        """Sizes the manifest records (and the CLI prints) beyond experts and KV; none by default."""
        return {}
