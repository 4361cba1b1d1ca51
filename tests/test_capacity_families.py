"""The capacity planner's 2026 built-ins (Qwen3.5/3.6, GLM-4.5/4.6/4.5-Air, MiniMax-M2), and the families VAMP
refuses, which the planner refuses for the same reason."""

import json

import pytest
from test_capacity import H200_TP4, _refused, _run

from vamp_sglang.capacity.models import BUILTIN


@pytest.mark.parametrize("builtin,config_class", [
    ("glm-4.5-air", "Glm4MoeConfig"), ("minimax-m2", "MiniMaxM2Config"),
    ("qwen3.6-35b-a3b", "Qwen3_5MoeTextConfig")])
def test_builtins_equal_transformers_defaults_where_those_describe_the_real_model(builtin, config_class):
    """transformers' defaults for these classes are the published models (GLM-4.5-Air, MiniMax-M2,
    Qwen3.5/3.6-35B-A3B's text model): every geometry key the built-in writes agrees with them."""
    import transformers

    defaults = getattr(transformers, config_class)().to_dict()
    shared = {k for k in BUILTIN[builtin]
              if k in defaults and k not in ("torch_dtype", "tie_word_embeddings")}
    assert len(shared) >= 8
    assert {k: BUILTIN[builtin][k] for k in shared} == {k: defaults[k] for k in shared}


@pytest.mark.parametrize("name,named", [
    ("openai/gpt-oss-120b", "MXFP4"), ("deepseek-ai/DeepSeek-V4", "DeepSeekV4TokenToKVPool"),
    ("moonshotai/Kimi-K2.5", "INT4")])
def test_a_family_vamp_refuses_for_what_it_lacks_is_not_planned_for_the_same_reason(name, named, capsys):
    err = _refused(["--model", name, *H200_TP4], capsys)
    assert "is not planned: VAMP refuses it" in err and named in err


def test_a_config_json_of_a_refused_family_is_not_planned(tmp_path, capsys):
    config = {**BUILTIN["mixtral-8x7b"], "architectures": ["GptOssForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "(GptOssForCausalLM) is not planned" in _refused(["--model", str(tmp_path), *H200_TP4], capsys)


def test_glm_4_6_and_qwen3_5_397b_read_their_moe_and_kv_layers(capsys):
    """GLM-4.6 at TP 8: 3 dense layers then 89 MoE layers (88 eligible), KV in all 92 (8 KV heads, one per
    rank, of 128); Qwen3.5-397B: 60 MoE layers (59 eligible), KV only in its 15 full-attention layers (2 KV
    heads replicated to one per rank, of 256)."""
    argv = ["--gpu-mem-gib", "140", "--tp", "8", "--json"]
    glm = _run(["--model", "zai-org/GLM-4.6", *argv], capsys)
    qwen = _run(["--model", "Qwen/Qwen3.5-397B-A17B", *argv], capsys)
    glm_geo, qwen_geo = glm["geometry"], qwen["geometry"]
    assert (glm_geo["eligible_layers"], glm_geo["kv_bytes_per_token"]) == (88, 92 * 2 * 128 * 2)
    assert (qwen_geo["eligible_layers"], qwen_geo["kv_bytes_per_token"]) == (59, 15 * 2 * 256 * 2)
    for plan in (glm, qwen):
        assert plan["ratios"]["0.2"]["kv_pool_tokens"] > plan["baseline"]["kv_pool_tokens"] > 0
