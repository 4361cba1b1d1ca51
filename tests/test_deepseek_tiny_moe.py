"""The tiny DeepSeek-V3 and V2 checkpoints (`--arch deepseek_v3|deepseek_v2`): MLA's geometry in the config
SGLang reads, a dense first layer, a shared expert, each version's routing, and transformers loading every
tensor (no missing or unused weights)."""

from __future__ import annotations

import json

import pytest
import torch

from vamp_sglang.tiny_moe.__main__ import main
from vamp_sglang.tiny_moe.checkpoint import ARCHS, make_checkpoint, read_manifest, spec_for

SMALL = {"layers": 3, "experts": 16, "hidden": 64, "intermediate": 32, "vocab": 512}


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def checkpoint(request, tmp_path_factory):
    return request.param, make_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, **SMALL)


def test_both_versions_are_archs():
    assert {"deepseek_v3", "deepseek_v2"} <= set(ARCHS)
    assert spec_for("deepseek_v2").q_lora_rank is None and spec_for("deepseek_v3").q_lora_rank is not None


def test_config_carries_mla_dense_first_layer_and_the_versions_routing(checkpoint):
    arch, out = checkpoint
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"deepseek_v3": "DeepseekV3ForCausalLM",
                                        "deepseek_v2": "DeepseekV2ForCausalLM"}[arch]]
    assert (config["kv_lora_rank"], config["qk_nope_head_dim"], config["qk_rope_head_dim"],
            config["v_head_dim"]) == (64, 32, 16, 32)
    assert config["q_lora_rank"] == (96 if arch == "deepseek_v3" else None)
    assert (config["first_k_dense_replace"], config["n_shared_experts"], config["n_routed_experts"]) == (1, 1, 16)
    assert config["num_key_value_heads"] == config["num_attention_heads"]
    routing = (config["topk_method"], config["scoring_func"])
    assert routing == (("noaux_tc", "sigmoid") if arch == "deepseek_v3" else ("greedy", "softmax"))
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 1.0


def test_sglang_reads_yarn_rope_scaling_and_routing(checkpoint):
    """SGLang reads the top-level fields through transformers' config (rope_scaling: CPU rope factory)."""
    import transformers

    arch, out = checkpoint
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["factor"] == 1.0
    assert config.scoring_func == ("sigmoid" if arch == "deepseek_v3" else "softmax")


def test_tensors_dense_first_layer_shared_expert_and_correction_bias(checkpoint):
    from safetensors import safe_open

    arch, out = checkpoint
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.experts.") or n == "model.layers.0.mlp.gate.weight"
                   for n in names)
    assert {f"model.layers.{i}.mlp.shared_experts.down_proj.weight" for i in (1, 2)} <= names
    assert sum(".mlp.experts." in n for n in names) == 2 * 16 * 3
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in names) == (arch == "deepseek_v3")
    assert ("model.layers.1.self_attn.q_a_proj.weight" in names) == (arch == "deepseek_v3")
    assert ("model.layers.1.self_attn.q_proj.weight" in names) == (arch == "deepseek_v2")


def test_manifest_prices_one_latent_row_per_layer(checkpoint):
    _, out = checkpoint
    manifest = read_manifest(out)
    assert manifest["kv_bytes_per_token"] == 3 * (64 + 16) * 4
    assert manifest["expert_bytes_per_layer"] == 16 * 3 * 64 * 32 * 4 and manifest["moe_layers"] == 2


def test_transformers_loads_every_tensor_and_runs(checkpoint):
    import transformers

    _, out = checkpoint
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(torch.tensor([[11, 12, 13, 14]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("bad, message", [({"dense_layers": 3}, "dense_layers=3"),
                                          ({"expert_groups": 3}, "expert_groups=3"),
                                          ({"qk_rope_head_dim": 3}, "qk_rope_head_dim=3")])
def test_bad_geometry_names_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        spec_for("deepseek_v3", **SMALL, **bad).validate()


def test_cli_writes_deepseek(tmp_path, capsys):
    main([str(tmp_path), "--arch", "deepseek_v2", "--layers", "2", "--experts", "8", "--hidden", "64",
          "--intermediate", "16"])
    line = capsys.readouterr().out
    assert "deepseek_v2" in line and "kv_bytes_per_token=640" in line and "kv_cache_dim=80" in line
