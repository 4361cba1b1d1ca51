"""Per-rank model geometry from a Hugging Face style config dict: expert shard bytes and KV bytes per token.

Why: the expert layout (paper V-A) and the planner need the sizes of one rank's expert shards and KV rows
before any weight exists (the benchmark prints them for models we cannot load here). Tensor parallelism
as SGLang does it for MoE without expert parallelism: every rank holds all E experts, each sliced on the
intermediate dimension; KV heads are split over ranks, and replicated when there are fewer heads than ranks.

Reads Qwen2/Qwen3-MoE (`num_experts`, `moe_intermediate_size`, `decoder_sparse_step`, `mlp_only_layers`),
Qwen3-Next (`full_attention_interval` or `layer_types`: only full-attention layers hold a KV cache) and
Mixtral (`num_local_experts`, `intermediate_size`) keys. Pure Python.

`python -m vamp_sglang.memory.geometry --model qwen3-next-80b-a3b --tp 2 --ratios 0.15,0.2` prints the
paper's Table II from this geometry and the expert layout: groups offloaded per eligible layer at VAMP-r
(the first MoE layer stays resident, V-B; groups of whole pages, V-A; the VAMP-r bound, IV-C), the bytes
they reclaim per GPU, and the physical KV pool once those pages are split evenly over the K and V buffers
of every full-attention layer, from the start-up pool `--kv-pool-gib`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vamp_sglang.memory.layout import ExpertLayout, kv_pages_per_buffer

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1}


class GeometryError(ValueError):
    """A config dict the geometry cannot be read from; the message names the key."""


@dataclass(frozen=True)
class ModelGeometry:
    """One TP rank's share of an MoE model's experts and KV cache."""

    num_layers: int
    moe_layer_ids: tuple[int, ...]
    kv_layer_ids: tuple[int, ...]  # layers that hold a KV cache (all but linear-attention ones)
    local_experts: int  # E per rank (TP-only: all experts)
    hidden_size: int
    moe_intermediate_per_rank: int  # I / tp
    kv_heads_per_rank: int
    head_dim: int
    dtype_bytes: int
    tp_size: int

    @property
    def w13_shard_bytes(self) -> int:
        """One expert's gate+up weight on this rank: [2 * I/tp, H]."""
        return 2 * self.moe_intermediate_per_rank * self.hidden_size * self.dtype_bytes

    @property
    def w2_shard_bytes(self) -> int:
        """One expert's down weight on this rank: [H, I/tp]."""
        return self.hidden_size * self.moe_intermediate_per_rank * self.dtype_bytes

    @property
    def kv_row_bytes(self) -> int:
        """One token's K (or V) in one layer on this rank: heads * head_dim * itemsize."""
        return self.kv_heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V over every KV layer on this rank."""
        return 2 * len(self.kv_layer_ids) * self.kv_row_bytes

    @property
    def expert_bytes_per_layer(self) -> int:
        return self.local_experts * (self.w13_shard_bytes + self.w2_shard_bytes)


def geometry_from_config(config: Mapping[str, Any], tp_size: int, dtype: str) -> ModelGeometry:
    """Read a Qwen2/Qwen3-MoE, Qwen3-Next or Mixtral config dict for one rank of `tp_size`."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise GeometryError(f"tp_size must be a positive integer (got {tp_size!r})")
    if dtype not in DTYPE_BYTES:
        raise GeometryError(f"dtype must be one of {', '.join(DTYPE_BYTES)} (got {dtype!r})")
    layers = _int(config, "num_hidden_layers")
    hidden = _int(config, "hidden_size")
    if "num_local_experts" in config:  # Mixtral: every layer is MoE, experts use intermediate_size
        experts, inter = _int(config, "num_local_experts"), _int(config, "intermediate_size")
        moe_ids = tuple(range(layers))
    else:
        experts, inter = _int(config, "num_experts"), _int(config, "moe_intermediate_size")
        moe_ids = _qwen_moe_layers(config, layers)
    if inter % tp_size:
        raise GeometryError(f"moe intermediate size {inter} is not divisible by tp_size {tp_size}")
    kv_heads = _int(config, "num_key_value_heads")
    head_dim = int(config.get("head_dim") or hidden // _int(config, "num_attention_heads"))
    return ModelGeometry(
        num_layers=layers, moe_layer_ids=moe_ids, kv_layer_ids=_kv_layers(config, layers),
        local_experts=experts, hidden_size=hidden, moe_intermediate_per_rank=inter // tp_size,
        kv_heads_per_rank=max(1, kv_heads // tp_size), head_dim=head_dim, dtype_bytes=DTYPE_BYTES[dtype],
        tp_size=tp_size)


def _qwen_moe_layers(config: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Hugging Face's rule: MoE unless in mlp_only_layers, every decoder_sparse_step-th layer."""
    step = int(config.get("decoder_sparse_step", 1))
    mlp_only = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)


def _kv_layers(config: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Qwen3-Next keeps KV only in its full-attention layers (every full_attention_interval-th)."""
    if config.get("layer_types"):
        types = list(config["layer_types"])
        if len(types) != layers:
            raise GeometryError(f"layer_types has {len(types)} entries for {layers} layers")
        return tuple(i for i, kind in enumerate(types) if kind != "linear_attention")
    interval = config.get("full_attention_interval")
    if interval:
        return tuple(i for i in range(layers) if (i + 1) % int(interval) == 0)
    return tuple(range(layers))


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise GeometryError(f"config key {key!r} must be a positive integer (got {value!r})")
    return value


def dense_weight_bytes(config: Mapping[str, Any], tp_size: int, dtype: str) -> int:
    """Bytes of every weight one rank holds besides the routed experts: embeddings and LM head
    (vocab-parallel), attention (heads split, KV heads replicated below tp), Qwen3-Next's
    linear-attention layers, shared experts, routers and dense MLP layers.

    Why: the KV pool at start is what the memory budget leaves after the weights (the capacity
    planner's baseline, before any expert leaves). Norms and biases are left out (well under 0.1%)."""
    geo = geometry_from_config(config, tp_size, dtype)
    hidden, tp = geo.hidden_size, tp_size
    vocab = _int(config, "vocab_size")
    params = vocab * hidden // tp * (1 if config.get("tie_word_embeddings") else 2)
    q_width = _int(config, "num_attention_heads") * geo.head_dim // tp
    q_gate = 2 if config.get("model_type") == "qwen3_next" else 1  # Qwen3-Next gates attention output by q
    attention = hidden * q_width * (q_gate + 1) + 2 * hidden * geo.kv_heads_per_rank * geo.head_dim
    params += attention * len(geo.kv_layer_ids)
    linear_layers = geo.num_layers - len(geo.kv_layer_ids)
    if linear_layers:  # Qwen3-Next Gated DeltaNet: qkvz and ba projections, conv, output projection
        key = _int(config, "linear_num_key_heads") * _int(config, "linear_key_head_dim")
        value = _int(config, "linear_num_value_heads") * _int(config, "linear_value_head_dim")
        kernel = int(config.get("linear_conv_kernel_dim", 4))
        heads_v = _int(config, "linear_num_value_heads")
        params += linear_layers * ((hidden * (2 * key + 2 * value) + hidden * 2 * heads_v
                                    + (2 * key + value) * kernel + value * hidden) // tp)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    params += len(geo.moe_layer_ids) * (geo.local_experts * hidden + 3 * hidden * shared // tp
                                        + (hidden if shared else 0))
    dense_mlp_layers = geo.num_layers - len(geo.moe_layer_ids)
    if dense_mlp_layers:
        params += dense_mlp_layers * 3 * hidden * _int(config, "intermediate_size") // tp
    return params * geo.dtype_bytes


# ---- Table II ---------------------------------------------------------------------------------------

GIB = 1 << 30
PAGE_BYTES = 2 << 20  # CUDA VMM allocation granularity on H100/H200 (paper V-A)
TABLE_I_KV_POOL_GIB = 8.0  # the paper's measured start-up pool per GPU, Qwen3-Next-80B-A3B TP2 on H100 (Table I)


@dataclass(frozen=True)
class ReclaimRow:
    """What VAMP-r reclaims on one GPU (Table II)."""

    ratio: float
    offloaded_groups: int  # per eligible layer
    reclaimed_bytes: int  # expert pages unmapped
    kv_pool_bytes: int  # physical pool: start-up pool plus the pages every K and V buffer gains


def reclaim_rows(geo: ModelGeometry, ratios: list[float], kv_pool_bytes: int,
                 page_bytes: int = PAGE_BYTES) -> list[ReclaimRow]:
    """Table II per ratio. Each K and V buffer of a KV layer gets the same whole number of the reclaimed
    pages (V-A), so the pool grows by at most the reclaimed bytes (the remainder pages stay spare)."""
    buffers = 2 * len(geo.kv_layer_ids)
    rows = []
    for ratio in ratios:
        lay = ExpertLayout.compute(geo.moe_layer_ids, geo.local_experts, geo.w13_shard_bytes, geo.w2_shard_bytes,
                                   page_bytes, ratio, staging_capacity_shards=geo.local_experts)
        groups = lay.bound_groups
        gained = kv_pages_per_buffer(groups, lay.pages_freed_per_group, buffers) * buffers * page_bytes
        rows.append(ReclaimRow(ratio, groups, groups * lay.bytes_freed_per_group, kv_pool_bytes + gained))
    return rows


def main(argv: list[str] | None = None) -> int:
    from vamp_sglang.capacity.models import ModelConfigError, config_dtype, load_model_config

    parser = argparse.ArgumentParser(prog="python -m vamp_sglang.memory.geometry",
                                     description="Expert memory VAMP-r reclaims per GPU (paper Table II)")
    parser.add_argument("--model", required=True, help="config.json, a directory holding one, or a built-in name")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--ratios", default="0.15,0.2", help="comma-separated offload ratios (default 0.15,0.2)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="weight and KV dtype (default: the config's)")
    parser.add_argument("--kv-pool-gib", type=float, default=TABLE_I_KV_POOL_GIB,
                        help=f"start-up KV pool per GPU in GiB (default {TABLE_I_KV_POOL_GIB}: the paper's measured "
                             "Qwen3-Next TP2 pool, Table I)")
    args = parser.parse_args(argv)
    try:
        ratios = [float(t) for t in args.ratios.split(",")]
        name, config = load_model_config(args.model)
        geo = geometry_from_config(config, args.tp, args.dtype or config_dtype(config))
        rows = reclaim_rows(geo, ratios, round(args.kv_pool_gib * GIB))
    except (ModelConfigError, GeometryError, ValueError) as exc:
        parser.error(str(exc))
    print(f"{name} at TP{args.tp}: {geo.local_experts} experts x {len(geo.moe_layer_ids)} MoE layers "
          f"({len(geo.moe_layer_ids) - 1} eligible), {len(geo.kv_layer_ids)} KV layers, {PAGE_BYTES >> 20} MiB pages")
    print(f"{'ratio':>6} {'groups':>6} {'reclaimed GiB/GPU':>17} {'pool GiB/GPU':>12}")
    print(f"{0:>6} {0:>6} {0.0:>17.2f} {args.kv_pool_gib:>12.2f}")
    for row in rows:
        print(f"{row.ratio:>6} {row.offloaded_groups:>6} {row.reclaimed_bytes / GIB:>17.2f} "
              f"{row.kv_pool_bytes / GIB:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
