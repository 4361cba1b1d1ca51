"""The tiny FP8 checkpoint (`--quant fp8`, issue 20) has the layout of the real FP8 checkpoints, and its
bf16 source is its exact dequantisation; CPU mode serves it in bfloat16."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vamp_sglang.block_fp8 import dequantise
from vamp_sglang.cpu import cpu_server_defaults
from vamp_sglang.tiny_moe import fp8
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint, read_manifest

SMALL = {"layers": 2, "experts": 4, "hidden": 128, "intermediate": 128, "heads": 2, "kv_heads": 2, "head_dim": 64,
         "vocab": 512}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny", quant="fp8", **SMALL)


def test_projections_are_block_fp8_and_the_rest_bf16(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    config = json.loads((checkpoint / "config.json").read_text())
    quantization = config["quantization_config"]
    assert quantization.pop("modules_to_not_convert") == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert quantization == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}
    assert config["dtype"] == "bfloat16"
    projections = [n for n in tensors if n.endswith("_proj.weight")]
    assert len(projections) == 2 * (4 + 4 * 3)  # q, k, v, o and 4 experts x gate, up, down per layer
    for name in projections:
        w, s = tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (w.shape[0] // 128, w.shape[1] // 128)
        assert bool((torch.log2(s) == torch.log2(s).round()).all()), "scales are powers of two"
    others = [n for n in tensors if not n.endswith(("_proj.weight", "weight_scale_inv"))]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"} <= set(others)
    assert all(tensors[n].dtype == torch.bfloat16 for n in others)


def test_the_bf16_source_is_the_exact_dequantisation(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    source = load_file(str(checkpoint / fp8.SOURCE_DIR / "model.safetensors"))
    assert "quantization_config" not in json.loads((checkpoint / fp8.SOURCE_DIR / "config.json").read_text())
    assert set(source) == {n for n in tensors if not n.endswith("weight_scale_inv")}
    for name, weight in source.items():
        assert weight.dtype == torch.bfloat16
        if tensors[name].dtype == torch.float8_e4m3fn:
            exact = dequantise(tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"])
            assert torch.equal(weight.float(), exact), name
        else:
            assert torch.equal(weight, tensors[name]), name
    manifest = read_manifest(checkpoint)
    assert manifest["spec"]["quant"] == "fp8" and "bf16/model.safetensors" in manifest["files"]
    assert manifest["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2  # layers x K,V x kv_heads x head_dim x bf16
    assert manifest["expert_bytes_per_layer"] == 4 * 3 * 128 * 128 + 4 * 3 * 4  # FP8 + one scale per block


def test_qwen3_next_keeps_its_odd_sized_and_gate_projections_in_bf16_and_lists_them(tmp_path):
    """Qwen3-Next-80B-A3B-FP8's layout: in_proj_ba (2 x value heads rows) and the gates stay bf16."""
    out = make_checkpoint(tmp_path / "next", arch="qwen3_next", quant="fp8", layers=4, experts=4, hidden=128,
                          intermediate=128, shared_intermediate=128, heads=2, kv_heads=2, vocab=512)
    tensors = load_file(str(out / "model.safetensors"))
    skipped = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.linear_attn.in_proj_ba" in skipped and "model.layers.0.mlp.shared_expert_gate" in skipped
    assert tensors["model.layers.0.linear_attn.in_proj_ba.weight"].dtype == torch.bfloat16
    for name in ("linear_attn.in_proj_qkvz", "linear_attn.out_proj", "mlp.shared_expert.down_proj",
                 "self_attn.q_proj"):
        layer = 3 if name.startswith("self_attn") else 0
        assert tensors[f"model.layers.{layer}.{name}.weight"].dtype == torch.float8_e4m3fn, name
    assert not any(s.endswith("_proj") and "in_proj_ba" not in s for s in skipped)


def test_dimensions_off_the_128_block_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "bad"
    run = subprocess.run([sys.executable, "-m", "vamp_sglang.tiny_moe", str(out), "--quant", "fp8",
                          "--hidden", "192"], check=False, capture_output=True, text=True)
    assert run.returncode == 2 and "quant=fp8 needs hidden=192 to be a multiple of 128" in run.stderr
    assert not out.exists()


def test_cpu_mode_serves_a_quantised_checkpoint_in_bf16_and_others_in_float32(checkpoint):
    def dtype(defaults):
        return defaults[defaults.index("--dtype") + 1]

    assert dtype(cpu_server_defaults(str(checkpoint))) == "bfloat16"  # FP8 takes bf16/fp16 activations
    assert dtype(cpu_server_defaults(str(checkpoint / fp8.SOURCE_DIR))) == "float32"
    assert dtype(cpu_server_defaults()) == "float32"
