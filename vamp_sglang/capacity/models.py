"""Model configs the capacity planner reads: a local `config.json`, or a built-in entry.

Why built-ins: an operator sizes a deployment before downloading 150 GB of weights. Each entry holds
the Hugging Face `config.json` keys the geometry reads (vamp_sglang.memory.geometry), copied from the
published model cards; any other model works through its own `config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_QWEN3_MOE = {"model_type": "qwen3_moe", "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 128,
              "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

BUILTIN: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next", "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 5120,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 151936,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen3-30b-a3b": {
        **_QWEN3_MOE, "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "num_attention_heads": 32, "num_key_value_heads": 4},
    "qwen3-235b-a22b": {
        **_QWEN3_MOE, "num_hidden_layers": 94, "hidden_size": 4096, "intermediate_size": 12288,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
        "num_attention_heads": 64, "num_key_value_heads": 4},
    "mixtral-8x7b": {
        "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
        "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}


class ModelConfigError(ValueError):
    """Neither a readable config.json nor a built-in name."""


def load_model_config(model: str) -> tuple[str, dict[str, Any]]:
    """(name, config dict) for a directory holding `config.json`, a `config.json` file, or a built-in
    name: case-insensitive, an organisation prefix and suffixes such as `-Instruct` ignored
    (`Qwen/Qwen3-Next-80B-A3B-Instruct` is `qwen3-next-80b-a3b`)."""
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
    key = model.lower().rsplit("/", 1)[-1]
    for name in sorted(BUILTIN, key=len, reverse=True):
        if key == name or key.startswith(name + "-"):
            return name, dict(BUILTIN[name])
    raise ModelConfigError(f"--model {model!r} is neither a config.json (or a directory holding one) nor a "
                           f"built-in model ({', '.join(BUILTIN)})")


def config_dtype(config: dict[str, Any]) -> str:
    """The checkpoint dtype as the config names it (`dtype` in new configs, `torch_dtype` in old)."""
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
