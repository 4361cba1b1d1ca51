"""The tiny MoE checkpoint: deterministic bytes, the issue's geometry, a working tokenizer, and a real
load through transformers (the same hub layout SGLang's loader reads)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vamp_sglang.tiny_moe.__main__ import main
from vamp_sglang.tiny_moe.checkpoint import ARCHS, MANIFEST, WEIGHTS, make_checkpoint, read_manifest, spec_for
from vamp_sglang.tiny_moe.common import TinyMoeSpec

SMALL = {"layers": 2, "experts": 8, "top_k": 2, "hidden": 64, "intermediate": 32,
         "heads": 4, "kv_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def small_qwen(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen"), seed=1, **SMALL)


def test_default_geometry_matches_issue():
    spec = spec_for()
    assert (spec.arch, spec.layers, spec.experts, spec.top_k, spec.hidden) == ("qwen3_moe", 6, 128, 2, 256)
    assert dataclasses.asdict(spec) == dataclasses.asdict(TinyMoeSpec())  # eval's benchmarks size from this
    assert spec.expert_bytes_per_layer == 96 * 2**20
    assert spec.kv_bytes_per_token == 6 * 1024
    # 25% of the five eligible layers' experts buys about 20k tokens (issue 2)
    tokens = int(0.25 * 5 * spec.expert_bytes_per_layer / spec.kv_bytes_per_token)
    assert 19_000 < tokens < 22_000


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, small_qwen):
    again = make_checkpoint(tmp_path / "again", seed=1, **SMALL)
    other = make_checkpoint(tmp_path / "other", seed=2, **SMALL)
    for name in (WEIGHTS, "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (small_qwen / name).read_bytes(), name
    assert (other / WEIGHTS).read_bytes() != (small_qwen / WEIGHTS).read_bytes()


def test_reuses_matching_checkpoint_and_rewrites_on_change(tmp_path):
    out = make_checkpoint(tmp_path, seed=3, **SMALL)
    written_ns = (out / WEIGHTS).stat().st_mtime_ns
    make_checkpoint(tmp_path, seed=3, **SMALL)
    assert (out / WEIGHTS).stat().st_mtime_ns == written_ns
    make_checkpoint(tmp_path, seed=4, **SMALL)
    assert read_manifest(out)["spec"]["seed"] == 4
    (out / WEIGHTS).write_bytes(b"truncated")
    make_checkpoint(tmp_path, seed=4, **SMALL)
    assert (out / WEIGHTS).stat().st_size == read_manifest(out)["files"][WEIGHTS]


def test_config_geometry(small_qwen):
    config = json.loads((small_qwen / "config.json").read_text())
    manifest = read_manifest(small_qwen)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    assert config["moe_intermediate_size"] == 32 and config["head_dim"] == 16
    assert config["num_key_value_heads"] == 2 and config["dtype"] == "float32"
    assert config["vocab_size"] == manifest["vocab_size"]
    assert manifest["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_tokenizer_round_trip_and_chat_template(small_qwen):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(small_qwen)
    text = "The baker walked to the harbour at 7 o'clock; memory is limited!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2  # BPE merged common words
    assert len(tokenizer) == 2048
    for token in ("<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert prompt == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_transformers_loads_every_tensor_and_runs(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    out = make_checkpoint(tmp_path, arch=arch, **SMALL)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert logits.shape == (1, 16, read_manifest(out)["vocab_size"]) and torch.isfinite(logits).all()
    assert logits[0, -1].softmax(-1).max() > 10 / logits.shape[-1]  # not flat
    assert len(set(generated.tolist())) > 1  # greedy decoding does not collapse at once


@pytest.mark.parametrize(
    "bad, field",
    [({"top_k": 9}, "top_k=9"), ({"arch": "llama"}, "arch='llama'"), ({"heads": 3}, "heads=3"),
     ({"layers": 0}, "layers=0"), ({"arch": "mixtral", "hidden": 128}, "heads\\*head_dim=64")],
)
def test_bad_geometry_names_the_field(tmp_path, bad, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        make_checkpoint(tmp_path, **{**SMALL, **bad})
    assert not (tmp_path / MANIFEST).exists()


def test_cli_prints_summary(tmp_path, capsys):
    main([str(tmp_path), "--arch", "mixtral", "--layers", "1", "--experts", "4", "--hidden", "64",
          "--intermediate", "16", "--heads", "4", "--kv-heads", "1", "--head-dim", "16"])
    line = capsys.readouterr().out
    assert "mixtral" in line and "expert_bytes_per_layer=49152 " in line and "kv_bytes_per_token=128 " in line
    assert read_manifest(tmp_path)["spec"]["experts"] == 4


NEXT_SMALL = {"layers": 4, "experts": 8, "hidden": 64, "intermediate": 32, "heads": 4, "kv_heads": 2,
              "head_dim": 16, "linear_head_dim": 16, "shared_intermediate": 32}


@pytest.fixture(scope="module")
def small_next(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("next"), arch="qwen3_next", seed=1, **NEXT_SMALL)


def test_qwen3_next_default_geometry():
    spec = spec_for("qwen3_next")
    assert (spec.layers, spec.full_attention_interval, spec.attention_layers) == (8, 4, (3, 7))
    assert (spec.linear_key_heads, spec.linear_value_heads, spec.linear_head_dim, spec.conv_kernel) == (2, 4, 64, 4)
    assert spec.expert_bytes_per_layer == 96 * 2**20 and spec.kv_bytes_per_token == 2048
    assert spec.linear_state_bytes == 6 * (4 * 64 * 64 + 512 * 3) * 4
    assert all(spec_for(arch).layers == 6 for arch in ARCHS if arch not in ("qwen3_next", "qwen3_5_moe"))  # hybrids: 8


def test_qwen3_next_config_is_what_sglang_reads(small_next):
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig

    config = json.loads((small_next / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["full_attention_interval"] == 4
    assert config["shared_expert_intermediate_size"] == 32 and config["linear_num_value_heads"] == 4
    sglang_config = Qwen3NextConfig.from_pretrained(small_next)
    assert sglang_config.layers_block_type == ["linear_attention"] * 3 + ["attention"]
    assert read_manifest(small_next)["linear_state_bytes"] == 3 * (4 * 16 * 16 + 128 * 3) * 4


def test_qwen3_next_tensors_and_neutral_norms(small_next):
    from safetensors.torch import load_file

    tensors = load_file(small_next / WEIGHTS)
    assert tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (2 * 32 + 2 * 64, 64)
    assert tensors["model.layers.0.linear_attn.conv1d.weight"].shape == (2 * 32 + 64, 1, 4)
    assert tensors["model.layers.3.self_attn.q_proj.weight"].shape == (4 * 16 * 2, 64)  # query + gate
    assert tensors["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert "model.layers.3.linear_attn.A_log" not in tensors and "model.layers.0.self_attn.q_proj.weight" not in tensors
    assert torch.equal(tensors["model.norm.weight"], torch.zeros(64))  # SGLang's GemmaRMSNorm scales by 1 + w
    assert torch.equal(tensors["model.layers.0.linear_attn.norm.weight"], torch.ones(16))
    decay = tensors["model.layers.0.linear_attn.A_log"].exp()
    assert bool(((decay >= 0.05) & (decay <= 1.0)).all())


def test_qwen3_next_same_seed_same_bytes(tmp_path, small_next):
    again = make_checkpoint(tmp_path / "again", arch="qwen3_next", seed=1, **NEXT_SMALL)
    assert (again / WEIGHTS).read_bytes() == (small_next / WEIGHTS).read_bytes()


def test_existing_arch_manifests_keep_their_fields(small_qwen):
    assert "linear_head_dim" not in read_manifest(small_qwen)["spec"]
