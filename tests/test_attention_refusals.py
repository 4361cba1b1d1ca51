"""Attention kernels that keep the KV pool's start-up size inside a captured decode graph are refused by the
launcher with VAMP on, naming the flags, before anything loads (review gpu-review-3, defects 1, 2 and 7): FP8
MLA latents unless every captured backend is triton, the TMA MLA backends, and fa3 paged KV where FA3 would
use TMA. With VAMP off the same flags reach SGLang; on CPU (no CUDA graphs) FP8 MLA latents are served."""

from __future__ import annotations

import json

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError

VAMP = ["--vamp-max-offload-ratio", "0.2"]
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "num_attention_heads": 128, "num_key_value_heads": 128}
QWEN_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 4}


def _model(tmp_path, config, name="model", extra=None):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for file, content in (extra or {}).items():
        (path / file).write_text(json.dumps(content))
    return ["--model-path", str(path)]


def _refused(argv, *named):
    with pytest.raises(ConfigError) as err:
        launch_server.prepare(argv + VAMP)
    for flag in named:
        assert flag in str(err.value), str(err.value)
    assert not launch_server.prepare(argv + ["--vamp-max-offload-ratio", "0"]).vamp.enabled  # SGLang decides


def _served(argv):
    assert launch_server.prepare(argv + VAMP).vamp.enabled


FP8_MLA_REFUSED = [  # (flags, the attention flag the refusal names)
    (["--kv-cache-dtype", "fp8_e4m3"], "--attention-backend"),  # SGLang's default: fa3 on Hopper
    (["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "fa3"], "--attention-backend fa3"),
    (["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "flashinfer"], "--attention-backend flashinfer"),
    (["--kv-cache-dtype", "fp8_e5m2", "--attention-backend", "flashinfer"], "--attention-backend flashinfer"),
    (["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "triton", "--decode-attention-backend", "fa3"],
     "--decode-attention-backend fa3"),
    # NGRAM's target verify runs on the prefill backend by default, inside the decode graph
    (["--kv-cache-dtype", "fp8_e4m3", "--decode-attention-backend", "triton",
      "--speculative-algorithm", "NGRAM"], "--attention-backend"),
]


@pytest.mark.parametrize("flags,named", FP8_MLA_REFUSED, ids=[" ".join(f) for f, _ in FP8_MLA_REFUSED])
def test_fp8_mla_latents_are_refused_unless_every_captured_backend_is_triton(tmp_path, flags, named):
    _refused(_model(tmp_path, DEEPSEEK) + flags, "--kv-cache-dtype", named, "latent pool")


@pytest.mark.parametrize("flags", [
    ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "triton"],
    ["--kv-cache-dtype", "fp8_e4m3", "--decode-attention-backend", "triton"],
    ["--kv-cache-dtype", "fp8_e4m3", "--decode-attention-backend", "triton",
     "--speculative-algorithm", "NGRAM", "--speculative-attention-mode", "decode"],
    ["--kv-cache-dtype", "fp8_e4m3", "--device", "cpu"],  # no CUDA graphs; converts only gathered rows
    ["--kv-cache-dtype", "bf16"],
    [],
], ids=" ".join)
def test_fp8_mla_latents_on_triton_on_cpu_and_bf16_latents_are_served(tmp_path, flags):
    _served(_model(tmp_path, DEEPSEEK) + flags)


def test_an_mha_model_keeps_its_fp8_kv_on_fa3(tmp_path):
    """FA3 casts q to FP8 for head_dim <= 256 and reads the cache in place: no whole-pool copy."""
    _served(_model(tmp_path, QWEN_MOE) + ["--kv-cache-dtype", "fp8_e4m3"])


@pytest.mark.parametrize("quant,extra", [
    ({"quant_method": "fp8", "kv_cache_quant_algo": "FP8"}, None),
    ({"quant_method": "modelopt", "kv_cache_scheme": {"type": "float", "num_bits": 8}}, None),
    (None, {"hf_quant_config.json": {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}}),
], ids=["kv_cache_quant_algo", "kv_cache_scheme", "hf_quant_config"])
def test_a_checkpoint_whose_kv_is_fp8_under_auto_is_refused_without_the_flag(tmp_path, quant, extra):
    config = {**DEEPSEEK, **({"quantization_config": quant} if quant else {})}
    _refused(_model(tmp_path, config, extra=extra), "--kv-cache-dtype auto", "--attention-backend")
    _served(_model(tmp_path, config, "triton", extra) + ["--attention-backend", "triton"])


def test_fp8_kv_on_a_model_without_a_local_config_is_refused_as_it_may_be_mla():
    _refused(["--model-path", "org/some-hub-model", "--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype",
             "may be MLA")


TMA_BACKENDS = ["flashmla", "trtllm_mla", "cutedsl_mla", "tokenspeed_mla"]


@pytest.mark.parametrize("flag", ["--attention-backend", "--decode-attention-backend",
                                  "--prefill-attention-backend"])
@pytest.mark.parametrize("backend", TMA_BACKENDS)
def test_mla_backends_that_bake_the_page_count_are_refused_by_name(tmp_path, flag, backend):
    _refused(_model(tmp_path, DEEPSEEK) + [flag, backend], f"{flag} {backend}", "TMA")


def test_the_refused_backends_are_names_sglang_accepts():
    """Each refused name is one SGLang 0.5.23 offers (cutlass_mla is not: SGLang's own parser refuses it)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

    assert set(TMA_BACKENDS) <= set(ATTENTION_BACKEND_CHOICES)
    assert "cutlass_mla" not in ATTENTION_BACKEND_CHOICES


FA3_TMA_REFUSED = [  # (config, flags, query rows per KV head in the message)
    (DEEPSEEK, ["--page-size", "64"], "128"),  # TP1: 128 heads over one latent head
    (DEEPSEEK, ["--page-size", "128", "--attention-backend", "fa3"], "128"),
    (DEEPSEEK, ["--page-size", "64", "--tp-size", "8", "--attn-dp-size", "8"], "128"),  # attention TP 1 again
    (QWEN_MOE, ["--page-size", "64", "--speculative-algorithm", "NGRAM"], "96"),  # 12 draft tokens x 8
    (None, ["--page-size", "64"], "an unknown number of"),
]


@pytest.mark.parametrize("config,flags,rows", FA3_TMA_REFUSED,
                         ids=[" ".join(f) for _, f, _ in FA3_TMA_REFUSED])
def test_fa3_paged_kv_that_would_use_tma_is_refused(tmp_path, config, flags, rows):
    model = _model(tmp_path, config) if config else ["--model-path", "/nonexistent/model"]
    _refused(model + flags, "--page-size", "--attention-backend", f"at {rows} query rows per KV head")


@pytest.mark.parametrize("config,flags", [
    (DEEPSEEK, ["--page-size", "32"]),  # below every FA3 kBlockN
    (DEEPSEEK, ["--page-size", "64", "--tp-size", "2"]),  # 64 rows: not above kBlockM
    (DEEPSEEK, ["--page-size", "64", "--attention-backend", "triton"]),
    (DEEPSEEK, ["--page-size", "64", "--decode-attention-backend", "flashinfer"]),
    (QWEN_MOE, ["--page-size", "128"]),  # 8 rows
    (QWEN_MOE, ["--page-size", "64", "--speculative-algorithm", "NGRAM",
                "--speculative-num-draft-tokens", "8"]),
    (DEEPSEEK, ["--page-size", "64", "--device", "cpu"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_fa3_paged_kv_shown_non_tma_is_served(tmp_path, config, flags):
    _served(_model(tmp_path, config) + flags)
