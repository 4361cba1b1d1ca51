"""What a hybrid linear-attention model (Qwen3-Next) needs from SGLang 0.5.23 on CPU, set by the launcher.

Read from the model's config.json before SGLang loads (a hub name without a local config.json counts as
not hybrid). For such a model with `--device cpu` the launcher adds, unless the user gave them:
- `--disable-overlap-schedule`: with overlap on, SGLang picks the `extra_buffer` mamba radix strategy,
  whose validation accepts only GPU devices and fails the start (server_args mamba_hook.py); without
  it the strategy is `no_buffer`, which checkpoints a state after each prefill, so multi-turn chat
  still reuses its earlier turns.
- `--max-mamba-cache-size 64`: otherwise SGLang sizes the linear-attention state pool from free RAM
  (most of the machine on CPU), which `--max-total-tokens` does not cap. With the radix cache each
  running request holds up to 3 slots, so 64 slots serve 21 requests at once.
- `SGLANG_MAMBA_CONV_DTYPE=float32`: the conv state is bfloat16 by default; float32 keeps the server's
  greedy output equal to a float32 reference.
"""

from __future__ import annotations

from collections.abc import Mapping

from vamp_sglang.local_config import local_model_config

HYBRID_MODEL_TYPES = ("qwen3_next",)
MAMBA_SLOTS = 64


def is_hybrid_linear(model_path: str | None) -> bool:
    """True when model_path is a local checkpoint whose config has linear-attention layers, at its top level
    or in its `text_config` (a vision-language wrapper such as Qwen3_5MoeForConditionalGeneration)."""
    config = local_model_config(model_path)
    return any(part.get("model_type") in HYBRID_MODEL_TYPES or "linear_attention" in (part.get("layer_types") or ())
               for part in (config, config.get("text_config") or {}))


def hybrid_cpu_defaults() -> list[str]:
    """SGLang flags for a hybrid model on CPU (see the module docstring)."""
    return ["--disable-overlap-schedule", "--max-mamba-cache-size", str(MAMBA_SLOTS)]


def hybrid_cpu_environment(base_env: Mapping[str, str]) -> dict[str, str]:
    """The variables to set for a hybrid model on CPU; a user's own SGLANG_MAMBA_CONV_DTYPE is kept."""
    return {"SGLANG_MAMBA_CONV_DTYPE": base_env.get("SGLANG_MAMBA_CONV_DTYPE") or "float32"}
