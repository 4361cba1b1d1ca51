"""The launcher sets what a hybrid (Qwen3-Next) model needs on CPU, from the model's config.json."""

from __future__ import annotations

import json

import pytest

from vamp_sglang.cpu.hybrid_model import is_hybrid_linear
from vamp_sglang.launch_server import prepare


def _model(tmp_path, name, config):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def next_model(tmp_path):
    return _model(tmp_path, "next", {"model_type": "qwen3_next", "layer_types": ["linear_attention"]})


def test_detects_hybrid_configs_only(tmp_path, next_model):
    assert is_hybrid_linear(next_model)
    assert is_hybrid_linear(_model(tmp_path, "other", {"model_type": "x", "layer_types": ["linear_attention"]}))
    assert not is_hybrid_linear(_model(tmp_path, "moe", {"model_type": "qwen3_moe"}))
    wrapper = {"model_type": "qwen3_5_moe", "text_config": {"layer_types": ["linear_attention", "full_attention"]}}
    assert is_hybrid_linear(_model(tmp_path, "qwen3_5_vl", wrapper))  # Qwen3.5's published layout
    assert not is_hybrid_linear("Qwen/Qwen3-Next-80B-A3B-Instruct")  # no local config: left to SGLang
    assert not is_hybrid_linear(None)


def test_hybrid_on_cpu_gets_overlap_off_a_capped_state_pool_and_fp32_conv_state(next_model, monkeypatch):
    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE", raising=False)
    launch = prepare(["--model-path", next_model, "--device", "cpu", "--vamp-max-offload-ratio", "0"])
    argv = launch.sglang_argv
    assert "--disable-overlap-schedule" in argv
    assert argv[argv.index("--max-mamba-cache-size") + 1] == "64"
    assert launch.env["SGLANG_MAMBA_CONV_DTYPE"] == "float32"


def test_user_choices_win(next_model, monkeypatch):
    monkeypatch.setenv("SGLANG_MAMBA_CONV_DTYPE", "bfloat16")
    launch = prepare(["--model", next_model, "--device", "cpu", "--vamp-max-offload-ratio", "0",
                      "--max-mamba-cache-size", "9"])
    argv = launch.sglang_argv
    assert argv.count("--max-mamba-cache-size") == 1 and argv[argv.index("--max-mamba-cache-size") + 1] == "9"
    assert launch.env["SGLANG_MAMBA_CONV_DTYPE"] == "bfloat16"


def test_not_for_other_models_or_gpus(tmp_path, next_model):
    moe = _model(tmp_path, "moe", {"model_type": "qwen3_moe"})
    cpu_moe = prepare(["--model-path", moe, "--device", "cpu", "--vamp-max-offload-ratio", "0"])
    gpu_next = prepare(["--model-path", next_model, "--vamp-max-offload-ratio", "0"])
    for launch in (cpu_moe, gpu_next):
        assert "--disable-overlap-schedule" not in launch.sglang_argv
        assert "--max-mamba-cache-size" not in launch.sglang_argv
        assert "SGLANG_MAMBA_CONV_DTYPE" not in launch.env
