"""MLA pools VAMP cannot grow are refused by the launcher before anything loads, naming the flag or the
config field: DeepSeek Sparse Attention's indexer cache (a DSA architecture with index_topk), KV dtypes with
per-layer scale buffers. MTP draft pools (--speculative-algorithm NEXTN) grow with the target's and are served.
With VAMP off they reach SGLang."""

from __future__ import annotations

import json

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError
from vamp_sglang.refusals import mla as mla_refusals


def _model(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], **config}))
    return ["--model-path", str(tmp_path), "--device", "cpu"]


def test_a_dsa_model_is_refused_naming_index_topk(tmp_path):
    model = _model(tmp_path, index_topk=2048)
    with pytest.raises(ConfigError, match="index_topk.*DSATokenToKVPool.*--vamp-max-offload-ratio 0"):
        launch_server.prepare(model + ["--vamp-max-offload-ratio", "0.2"])
    assert not launch_server.prepare(model + ["--vamp-max-offload-ratio", "0"]).vamp.enabled


def test_plain_mla_deepseek_is_served(tmp_path):
    launch = launch_server.prepare(_model(tmp_path, kv_lora_rank=512) + ["--vamp-max-offload-ratio", "0.2"])
    assert launch.vamp.enabled and "--radix-cache-backend" in launch.sglang_argv


@pytest.mark.parametrize("dtype", mla_refusals.SCALED_KV_DTYPES)
def test_kv_dtypes_with_scale_buffers_are_refused_naming_the_flag(tmp_path, dtype):
    flags = _model(tmp_path) + ["--kv-cache-dtype", dtype]
    with pytest.raises(ConfigError, match=f"--kv-cache-dtype {dtype}"):
        launch_server.prepare(flags + ["--vamp-max-offload-ratio", "0.2"])
    launch_server.prepare(flags + ["--vamp-max-offload-ratio", "0"])


def test_plain_fp8_latents_are_not_refused(tmp_path):
    """FP8 MLA latents are one byte per value in the same one-buffer-per-layer pool (no scale buffer)."""
    assert launch_server.prepare(_model(tmp_path) + ["--kv-cache-dtype", "fp8_e4m3",
                                                     "--vamp-max-offload-ratio", "0.2"]).vamp.enabled


def test_an_mtp_draft_is_served_and_a_standalone_draft_refused_naming_the_flag(tmp_path):
    model = _model(tmp_path)
    assert launch_server.prepare(model + ["--speculative-algorithm", "NEXTN", "--vamp-max-offload-ratio", "0.2"]).vamp.enabled
    with pytest.raises(ConfigError, match="--speculative-algorithm STANDALONE"):
        launch_server.prepare(model + ["--speculative-algorithm", "STANDALONE", "--vamp-max-offload-ratio", "0.2"])
