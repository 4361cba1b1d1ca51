"""Bytes of every weight one TP rank holds besides the routed experts, as SGLang lays them out.

Why: the KV pool at start is what the memory budget leaves after the weights (the capacity planner's
baseline, before any expert leaves), and with FP8 checkpoints most of those weights are 1 byte per element.

Each linear layer is priced on its per-rank shape: column-parallel layers split their output rows over the
TP ranks, row-parallel ones their input columns, replicated ones neither. Under DP attention the attention
layers (MLA's projections, Qwen3-Next's linear attention too) split over the attention-TP group only
(tp / dp ranks: with attention-TP 1 each rank holds every head), while the experts, shared experts, dense MLP
layers and the vocab-parallel embeddings and LM head keep the whole TP group (SGLang's defaults, without
`--enable-dp-lm-head` or a fully data-parallel dense FFN). A layer the config's block-FP8
`quantization_config` converts (not in its `modules_to_not_convert`) is float8_e4m3fn plus one float32
scale per 128x128 block of the per-rank shape; the others are the model dtype. Never FP8, as in SGLang:
embeddings and LM head (vocab-parallel), the MoE routers, Qwen's shared-expert gate and Qwen3-Next's conv1d.

Left out: norms, biases, DeepSeek's e_score_correction_bias (each well under 0.1%), and the copies SGLang
makes of an MLA layer's kv_b_proj for the absorbed decode (w_kc / w_vc, ~0.3% of DeepSeek-V3 at TP8), and
DeepSeek's multi-token-prediction layer (loaded only with speculative decoding: capacity/draft.py prices it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vamp_sglang.memory.geometry import (
    DTYPE_BYTES,
    config_int,
    geometry_from_config,
    kv_heads_per_rank,
    weight_quant_from_config,
)


def dense_weight_bytes(config: Mapping[str, Any], tp_size: int, dtype: str, attn_tp_size: int | None = None,
                       ep_size: int = 1) -> int:
    """Embeddings and LM head, attention (heads split, KV heads replicated below tp; MLA's low-rank
    projections), Qwen3-Next's linear-attention layers, shared experts, routers and dense MLP layers.
    `attn_tp_size` (DP attention: tp / dp) is the group the attention layers split over; None: the TP group.
    `ep_size` changes none of these (the router scores every expert on every rank); it is passed on so that
    the expert split it allows (an FP8 block SGLang accepts at tp / ep) reads."""
    geo = geometry_from_config(config, tp_size, dtype, ep_size)
    quant = weight_quant_from_config(config)
    element = DTYPE_BYTES[dtype]
    hidden, tp, attn_tp = geo.hidden_size, tp_size, attn_tp_size or tp_size

    def split_over(parts: int):
        def linear(module: str, rows: int, cols: int, split: str = "column") -> int:
            """One [rows, cols] weight on this rank; `split` is column (rows / parts), row (cols / parts) or none."""
            rows, cols = (rows // parts, cols) if split == "column" else (rows, cols // parts) if split == "row" \
                else (rows, cols)
            if quant is not None and quant.converts(module):
                return rows * cols + quant.scale_bytes(rows, cols)
            return rows * cols * element
        return linear

    linear, attn_linear = split_over(tp), split_over(attn_tp)

    vocab = config_int(config, "vocab_size")
    total = (vocab * hidden // tp * element) * (1 if config.get("tie_word_embeddings") else 2)
    if geo.mla_latent_dim:
        total += len(geo.kv_layer_ids) * _mla_attention(config, hidden, attn_linear)
    else:
        heads = config_int(config, "num_attention_heads")
        q_gate = 2 if config.get("model_type") == "qwen3_next" else 1  # Qwen3-Next gates attention output by q
        kv_rows = kv_heads_per_rank(config, attn_tp) * geo.head_dim * attn_tp  # k (and v) rows before the split
        total += len(geo.kv_layer_ids) * (
            attn_linear("self_attn.q_proj", heads * geo.head_dim * q_gate, hidden)
            + attn_linear("self_attn.k_proj", kv_rows, hidden) + attn_linear("self_attn.v_proj", kv_rows, hidden)
            + attn_linear("self_attn.o_proj", hidden, heads * geo.head_dim, "row"))
    linear_layers = geo.num_layers - len(geo.kv_layer_ids)
    if linear_layers:  # Qwen3-Next Gated DeltaNet: qkvz and ba projections, conv, output projection
        key = config_int(config, "linear_num_key_heads") * config_int(config, "linear_key_head_dim")
        value = config_int(config, "linear_num_value_heads") * config_int(config, "linear_value_head_dim")
        kernel = int(config.get("linear_conv_kernel_dim", 4))
        heads_v = config_int(config, "linear_num_value_heads")
        total += linear_layers * (
            attn_linear("linear_attn.in_proj_qkvz", 2 * key + 2 * value, hidden)
            + attn_linear("linear_attn.in_proj_ba", 2 * heads_v, hidden)
            + (2 * key + value) * kernel // attn_tp * element  # conv1d: never quantised
            + attn_linear("linear_attn.out_proj", hidden, value, "row"))
    moe_layers = len(geo.moe_layer_ids)
    shared = _shared_expert_intermediate(config)
    router = geo.routed_experts * hidden * element  # replicated, model dtype
    total += moe_layers * (router + _mlp(linear, "mlp.shared_expert" if "num_experts" in config
                                         else "mlp.shared_experts", hidden, shared))
    if shared and "num_experts" in config:  # Qwen's sigmoid gate on the shared expert: [1, H], replicated
        total += moe_layers * hidden * element
    dense_mlp_layers = geo.num_layers - moe_layers
    if dense_mlp_layers:
        total += dense_mlp_layers * _mlp(linear, "mlp", hidden, config_int(config, "intermediate_size"))
    return total


def _mlp(linear, prefix: str, hidden: int, intermediate: int) -> int:
    """A SwiGLU MLP: gate and up column-parallel, down row-parallel (nothing when intermediate is 0)."""
    if not intermediate:
        return 0
    return (linear(f"{prefix}.gate_proj", intermediate, hidden) + linear(f"{prefix}.up_proj", intermediate, hidden)
            + linear(f"{prefix}.down_proj", hidden, intermediate, "row"))


def _shared_expert_intermediate(config: Mapping[str, Any]) -> int:
    """Qwen's shared_expert_intermediate_size, or DeepSeek's n_shared_experts x moe_intermediate_size."""
    if "n_routed_experts" in config:
        return int(config.get("n_shared_experts") or 0) * config_int(config, "moe_intermediate_size")
    return int(config.get("shared_expert_intermediate_size") or 0)


def _mla_attention(config: Mapping[str, Any], hidden: int, linear) -> int:
    """One MLA layer (SGLang's DeepseekV2AttentionMLA): q low-rank (or a plain q_proj when q_lora_rank is
    null), the replicated kv_a projection to the latent and its rope key, kv_b up to every head, o_proj."""
    heads = config_int(config, "num_attention_heads")
    nope, rope = config_int(config, "qk_nope_head_dim"), config_int(config, "qk_rope_head_dim")
    v_dim, kv_rank = config_int(config, "v_head_dim"), config_int(config, "kv_lora_rank")
    q_rank = config.get("q_lora_rank")
    if q_rank:
        q = linear("self_attn.q_a_proj", int(q_rank), hidden, "none") + linear(
            "self_attn.q_b_proj", heads * (nope + rope), int(q_rank))
    else:
        q = linear("self_attn.q_proj", heads * (nope + rope), hidden)
    return (q + linear("self_attn.kv_a_proj_with_mqa", kv_rank + rope, hidden, "none")
            + linear("self_attn.kv_b_proj", heads * (nope + v_dim), kv_rank)
            + linear("self_attn.o_proj", hidden, heads * v_dim, "row"))
