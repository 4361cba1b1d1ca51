"""Model configs the capacity planner reads: a local `config.json`, or a built-in entry.

Why built-ins: an operator sizes a deployment before downloading 150 GB of weights. Each entry holds
the Hugging Face `config.json` keys the geometry reads (vamp_sglang.memory.geometry), copied from the
published configs, with the `quantization_config` of the FP8 checkpoints; any other model works through
its own `config.json`.

A name is a built-in when, lower-cased, without its organisation prefix (`Qwen/`) and without the
variant words that do not change the weights (`-Instruct`, `-Thinking`, `-Base`, `-Chat`, and revisions
such as `-2507`, `-0905`, `-v0.1`), it equals a built-in exactly: `Qwen/Qwen3-Next-80B-A3B-Instruct-FP8`
is `qwen3-next-80b-a3b-fp8`. Anything else (`-FP8` dropped, `-AWQ`, `-GPTQ-Int4`, `Kimi-K2-Thinking`,
whose experts are INT4) is refused: a near miss must not be priced as another checkpoint.
A family VAMP refuses for what it lacks (gpt-oss, DeepSeek-V4, Kimi-K2.5; `NOT_PLANNED`), by name or by
its config.json's `architectures`, is refused with the launcher's reason (vamp_sglang/refusals/families.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from vamp_sglang.refusals.families import BY_ARCH

# DeepSeek-V3's published quantization_config (README_WEIGHTS.md); Kimi-K2 ships the same block.
_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _qwen_fp8(base: dict[str, Any], per_layer: tuple[str, ...]) -> dict[str, Any]:
    """Qwen's FP8 checkpoints: the bf16 config plus the block-FP8 quantization_config; lm_head and each
    layer's router gate (and the modules in `per_layer`) are in modules_to_not_convert, kept bf16."""
    layers = base["num_hidden_layers"]
    skipped = ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(layers) for m in per_layer]
    return {**base, "quantization_config": {**_FP8, "modules_to_not_convert": skipped}}


_QWEN3_MOE = {"model_type": "qwen3_moe", "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 128,
              "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
_QWEN3_NEXT = {
    "model_type": "qwen3_next", "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 5120,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 151936,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# Qwen3.6-35B-A3B (and Qwen3.5-35B-A3B, the same text model): its `text_config`, Qwen3-Next's hybrid layout
# (3 Gated DeltaNet layers, then 1 full-attention layer) with 256 experts, top-8, over 40 layers.
_QWEN3_6_35B = {
    "model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "hidden_size": 2048, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "vocab_size": 248320, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
_QWEN3_30B = {**_QWEN3_MOE, "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
              "num_attention_heads": 32, "num_key_value_heads": 4}
_QWEN3_235B = {**_QWEN3_MOE, "num_hidden_layers": 94, "hidden_size": 4096, "intermediate_size": 12288,
               "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
               "num_attention_heads": 64, "num_key_value_heads": 4}
# DeepSeek-V3 (and R1, the same architecture and checkpoint layout): MLA, 3 dense layers, 256 routed + 1
# shared expert per MoE layer, FP8 everywhere but embeddings, LM head, norms and the router.
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "vocab_size": 129280,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "quantization_config": dict(_FP8)}

# Qwen3.5-397B-A17B (bf16; Qwen/Qwen3.5-397B-A17B's card and text_config): hidden 4096, 60 layers laid out
# 15 x (3 Gated DeltaNet + 1 gated full attention), attention 32 query / 2 KV heads of 256, DeltaNet 16 QK /
# 64 V heads of 128, 512 experts of 1024 with top-10 and one shared expert of 1024, vocab 248320.
_QWEN3_5_397B = {**_QWEN3_6_35B, "num_hidden_layers": 60, "hidden_size": 4096, "num_experts": 512,
                 "num_experts_per_tok": 10, "moe_intermediate_size": 1024, "num_attention_heads": 32,
                 "shared_expert_intermediate_size": 1024, "linear_num_value_heads": 64}
# GLM-4.5 / GLM-4.6 (bf16; zai-org/GLM-4.6's config.json): hidden 5120, 92 layers, the first 3 dense
# (intermediate 12288), 160 routed experts of 1536 with top-8 and 1 shared, 96 query / 8 KV heads of 128,
# vocab 151552; its MTP layer (num_nextn_predict_layers 1) is loaded only for speculative decoding.
_GLM_4_6 = {
    "model_type": "glm4_moe", "num_hidden_layers": 92, "hidden_size": 5120, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151552, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# GLM-4.5-Air (bf16; zai-org/GLM-4.5-Air, transformers' Glm4MoeConfig defaults): hidden 4096, 46 layers, the
# first dense (10944), 128 routed experts of 1408 with top-8 and 1 shared, 96 query / 8 KV heads of 128.
_GLM_4_5_AIR = {**_GLM_4_6, "num_hidden_layers": 46, "hidden_size": 4096, "intermediate_size": 10944,
                "moe_intermediate_size": 1408, "n_routed_experts": 128, "first_k_dense_replace": 1}
# MiniMax-M2 (MiniMaxAI/MiniMax-M2, transformers' MiniMaxM2Config defaults): hidden 3072, 62 layers, every one
# MoE with 256 experts of 1536 and top-8, full attention with 48 query / 8 KV heads of 128, vocab 200064;
# block-FP8 weights but the router gate and LM head. The launcher refuses it until a tiny checkpoint and a
# server test check it (refusals/families.py); its plan is what VAMP would reclaim, as for any config.json.
_MINIMAX_M2 = {
    "model_type": "minimax_m2", "num_hidden_layers": 62, "hidden_size": 3072, "intermediate_size": 1536,
    "num_local_experts": 256, "num_experts_per_tok": 8, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 200064, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {**_FP8, "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}}
# Families VAMP refuses for what it lacks, not for a missing test: no plan would be served, so the planner
# refuses them with the launcher's reason (refusals/families.py). gpt-oss-120b: 36 layers, hidden 2880, 128
# experts of 2880 with top-4, 64 query / 8 KV heads of 64, a 128-token sliding window on every other layer,
# MXFP4 experts. DeepSeek-V4 (transformers' DeepseekV4Config defaults): 43 layers, hidden 4096, 256 experts of
# 2048 with top-6, one 512-wide KV head with compressed (4x, 128x) and indexer caches beside a 128-token
# window. Kimi-K2.5: Kimi-K2's text model (61 layers, 384 experts, MLA) with INT4 routed experts and MoonViT.
NOT_PLANNED = {"gpt-oss-120b": "GptOssForCausalLM", "deepseek-v4": "DeepseekV4ForCausalLM",
               "kimi-k2.5": "KimiK25ForConditionalGeneration"}

BUILTIN: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": _QWEN3_NEXT,
    "qwen3-next-80b-a3b-fp8": _qwen_fp8(_QWEN3_NEXT, ("mlp.gate", "mlp.shared_expert_gate",
                                                      "linear_attn.in_proj_ba")),
    "qwen3.6-35b-a3b": _QWEN3_6_35B,
    "qwen3.5-397b-a17b": _QWEN3_5_397B,
    "glm-4.5": _GLM_4_6,
    "glm-4.6": _GLM_4_6,
    "glm-4.5-air": _GLM_4_5_AIR,
    "minimax-m2": _MINIMAX_M2,
    "qwen3-30b-a3b": _QWEN3_30B,
    "qwen3-30b-a3b-fp8": _qwen_fp8(_QWEN3_30B, ("mlp.gate",)),
    "qwen3-235b-a22b": _QWEN3_235B,
    "qwen3-235b-a22b-fp8": _qwen_fp8(_QWEN3_235B, ("mlp.gate",)),
    "mixtral-8x7b": {
        "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
        "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-r1": _DEEPSEEK_V3,
    # Kimi-K2 (Instruct / Base, FP8): DeepSeek-V3's architecture with 384 experts, one dense layer, 64 heads.
    "kimi-k2": {
        **_DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384, "first_k_dense_replace": 1,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0, "vocab_size": 163840},
    # DeepSeek-V2-Lite (bf16): MLA without a q low-rank, 1 dense layer, 64 routed + 2 shared experts.
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "topk_method": "greedy", "scoring_func": "softmax", "vocab_size": 102400,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}

VARIANT_WORDS = ("instruct", "thinking", "base", "chat")  # post-training variants with the same weights
_REVISION = re.compile(r"^(\d{4}|v\d+\.\d+)$")  # -2507, -0905, -v0.1: a re-release of the same layout
DIFFERENT_WEIGHTS = {  # variant names whose checkpoint is NOT the built-in's layout
    "kimi-k2-thinking": "its experts are INT4 (compressed-tensors), which the planner cannot price",
}


class ModelConfigError(ValueError):
    """Neither a readable config.json nor a built-in name."""


def builtin_key(model: str) -> str:
    """The name as the built-ins spell it: lower case, no organisation, no variant words or revisions."""
    words = model.lower().rsplit("/", 1)[-1].split("-")
    return "-".join(w for w in words if w not in VARIANT_WORDS and not _REVISION.match(w))


def load_model_config(model: str) -> tuple[str, dict[str, Any]]:
    """(name, config dict) for a directory holding `config.json`, a `config.json` file, or a built-in name
    (matched exactly up to case, organisation, variant words and revisions: see the module docstring)."""
    file = config_file(model)
    if file.is_file():
        config = read_config(file, f"--model {model}")
        if refused := sorted(set(config.get("architectures") or ()) & set(NOT_PLANNED.values())):
            raise ModelConfigError(f"--model {model} ({refused[0]}) is not planned: VAMP refuses it, "
                                   f"{BY_ARCH[refused[0]].reason}")
        return str(file), config
    plain = "-".join(w for w in model.lower().rsplit("/", 1)[-1].split("-") if not _REVISION.match(w))
    if (key := builtin_key(model)) in NOT_PLANNED:
        raise ModelConfigError(f"--model {model!r} ({BY_ARCH[NOT_PLANNED[key]].name}) is not planned: VAMP "
                               f"refuses it, {BY_ARCH[NOT_PLANNED[key]].reason}")
    for name, why in DIFFERENT_WEIGHTS.items():
        if plain == name or plain.startswith(name + "-"):
            raise ModelConfigError(f"--model {model!r} is not priced: {why}; pass its config.json")
    if key in BUILTIN:
        return key, json.loads(json.dumps(BUILTIN[key]))  # a deep copy: callers may edit it
    raise ModelConfigError(
        f"--model {model!r} is neither a config.json (or a directory holding one) nor a built-in model "
        f"({', '.join(BUILTIN)}); a name must match one exactly, up to case, the organisation prefix, "
        f"-{'/-'.join(w.capitalize() for w in VARIANT_WORDS)} and a revision such as -2507 (a quantised "
        "variant such as -FP8 is a different model); pass the checkpoint's config.json otherwise")


def config_file(path_or_name: str) -> Path:
    """Where a config would be: `config.json` in a directory, or the path itself (which may not exist)."""
    path = Path(path_or_name)
    return path / "config.json" if path.is_dir() else path


def read_config(file: Path, flag: str) -> dict[str, Any]:
    """A config.json as a dict; a file that is not one is refused naming `flag` (the flag and its value)."""
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{flag}: cannot read {file}: {exc}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{flag}: {file} is not a JSON object")
    return config


def config_dtype(config: dict[str, Any]) -> str:
    """The checkpoint dtype as the config names it (`dtype` in new configs, `torch_dtype` in old): the
    KV cache and every unquantised weight; block-FP8 weights are 1 byte whatever it says."""
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
