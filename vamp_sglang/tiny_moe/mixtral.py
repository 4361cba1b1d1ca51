"""Mixtral (`--arch mixtral`), SGLang's MixtralForCausalLM: plain attention in every layer, then the
routed experts under Mixtral's own names (block_sparse_moe, w1/w3/w2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vamp_sglang.tiny_moe.common import TinyMoeSpec


@dataclass(frozen=True)
class MixtralSpec(TinyMoeSpec):
    """The common geometry as Mixtral lays it out."""

    arch: ClassVar[str] = "mixtral"
    architecture: ClassVar[str] = "MixtralForCausalLM"
    config_class: ClassVar[str] = "MixtralConfig"
    moe: ClassVar[str] = "block_sparse_moe"
    expert_projections: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")

    def checks(self) -> list[tuple[bool, str]]:
        """SGLang's Mixtral ignores the config's head_dim, so the heads must tile hidden exactly."""
        return super().checks() + [
            (self.heads * self.head_dim == self.hidden,
             (f"heads*head_dim={self.heads * self.head_dim} must equal hidden={self.hidden} for mixtral"
              " (SGLang derives head_dim from hidden)")),
        ]

    def config_fields(self, vocab_size: int, eos_id: int, pad_id: int) -> dict:
        """Mixtral calls its experts local experts and their width intermediate_size."""
        return super().config_fields(vocab_size, eos_id, pad_id) | {
            "num_local_experts": self.experts,
            "intermediate_size": self.intermediate,
        }
