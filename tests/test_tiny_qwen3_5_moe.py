"""`tiny_moe --arch qwen3_5_moe`: the text-only Qwen3.5 MoE checkpoint SGLang and transformers both read.

Qwen3-Next's geometry with Qwen3.5's four linear-attention projections (q/k/v, z, b, a) in the hub layout; SGLang's
own config class reads the hybrid layout from it, and transformers' Qwen3_5MoeForCausalLM (the reference of
tests/test_qwen3_5_moe_server.py) loads every tensor with none missing or left over.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_tiny_moe import NEXT_SMALL
from vamp_sglang.tiny_moe.checkpoint import WEIGHTS, make_checkpoint, read_manifest, spec_for


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_5"), arch="qwen3_5_moe", seed=1, **NEXT_SMALL)


def test_default_geometry_is_qwen3_nexts():
    spec, qwen3_next = spec_for("qwen3_5_moe"), spec_for("qwen3_next")
    assert spec.attention_layers == qwen3_next.attention_layers == (3, 7)
    assert (spec.expert_bytes_per_layer, spec.kv_bytes_per_token, spec.linear_state_bytes) == (
        qwen3_next.expert_bytes_per_layer, qwen3_next.kv_bytes_per_token, qwen3_next.linear_state_bytes)


def test_config_is_what_sglang_reads(small):
    from sglang.srt.configs.qwen3_5 import Qwen3_5MoeTextConfig

    config = json.loads((small / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"] and config["model_type"] == "qwen3_5_moe_text"
    sglang_config = Qwen3_5MoeTextConfig.from_pretrained(small)
    assert sglang_config.layers_block_type == ["linear_attention"] * 3 + ["attention"]
    assert (sglang_config.linear_num_key_heads, sglang_config.linear_num_value_heads) == (2, 4)
    assert read_manifest(small)["linear_state_bytes"] == 3 * (4 * 16 * 16 + 128 * 3) * 4


def test_tensors_are_qwen3_5s_separate_projections(small):
    from safetensors.torch import load_file

    tensors = load_file(small / WEIGHTS)
    p = "model.layers.0.linear_attn"
    assert tensors[f"{p}.in_proj_qkv.weight"].shape == (2 * 32 + 64, 64)
    assert tensors[f"{p}.in_proj_z.weight"].shape == (64, 64)
    assert tensors[f"{p}.in_proj_b.weight"].shape == tensors[f"{p}.in_proj_a.weight"].shape == (4, 64)
    assert f"{p}.in_proj_qkvz.weight" not in tensors and f"{p}.in_proj_ba.weight" not in tensors
    assert torch.equal(tensors["model.norm.weight"], torch.zeros(64))  # (1 + w) norms


def test_transformers_loads_every_tensor(small):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert not any(info.values()), info
