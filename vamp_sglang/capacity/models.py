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
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

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

BUILTIN: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": _QWEN3_NEXT,
    "qwen3-next-80b-a3b-fp8": _qwen_fp8(_QWEN3_NEXT, ("mlp.gate", "mlp.shared_expert_gate",
                                                      "linear_attn.in_proj_ba")),
    "qwen3.6-35b-a3b": _QWEN3_6_35B,
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
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if file.is_file():
        try:
            config = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"--model {model}: cannot read {file}: {exc}") from None
        if not isinstance(config, dict):
            raise ModelConfigError(f"--model {model}: {file} is not a JSON object")
        return str(file), config
    plain = "-".join(w for w in model.lower().rsplit("/", 1)[-1].split("-") if not _REVISION.match(w))
    for name, why in DIFFERENT_WEIGHTS.items():
        if plain == name or plain.startswith(name + "-"):
            raise ModelConfigError(f"--model {model!r} is not priced: {why}; pass its config.json")
    key = builtin_key(model)
    if key in BUILTIN:
        return key, json.loads(json.dumps(BUILTIN[key]))  # a deep copy: callers may edit it
    raise ModelConfigError(
        f"--model {model!r} is neither a config.json (or a directory holding one) nor a built-in model "
        f"({', '.join(BUILTIN)}); a name must match one exactly, up to case, the organisation prefix, "
        f"-{'/-'.join(w.capitalize() for w in VARIANT_WORDS)} and a revision such as -2507 (a quantised "
        "variant such as -FP8 is a different model); pass the checkpoint's config.json otherwise")


def config_dtype(config: dict[str, Any]) -> str:
    """The checkpoint dtype as the config names it (`dtype` in new configs, `torch_dtype` in old): the
    KV cache and every unquantised weight; block-FP8 weights are 1 byte whatever it says."""
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
