"""Per-rank model geometry from a Hugging Face style config dict: expert shard bytes and KV bytes per token.

Why: the expert layout (paper V-A) and the planner need the sizes of one rank's expert shards and KV rows
before any weight exists (the benchmark prints them for models we cannot load here). Tensor parallelism
as SGLang does it for MoE without expert parallelism: every rank holds all E routed experts, each sliced on
the intermediate dimension; KV heads are split over ranks, and replicated when there are fewer heads than
ranks; MLA's latent KV (`kv_lora_rank + qk_rope_head_dim` per token and layer, one buffer per layer) is not
split: SGLang's MLATokenToKVPool keeps the whole latent on every rank (its cell size has no TP factor).

Reads Qwen2/Qwen3-MoE (`num_experts`, `moe_intermediate_size`, `decoder_sparse_step`, `mlp_only_layers`),
Qwen3-Next (`full_attention_interval` or `layer_types`: only full-attention layers hold a KV cache),
Mixtral (`num_local_experts`, `intermediate_size`) and DeepSeek-V2/V3 / Kimi-K2 (`n_routed_experts`,
`first_k_dense_replace`, `moe_layer_freq`, MLA's `kv_lora_rank`) keys. Weights are the config's dtype, or
with a `quantization_config` of `quant_method: fp8` and `weight_block_size: [128, 128]` (DeepSeek-V3,
Kimi-K2, Qwen3-*-FP8) float8_e4m3fn, 1 byte per element, plus one float32 `weight_scale_inv` per 128x128
block. The pages VAMP moves are the fp8 expert weights; the scales (~1/4096 of them) stay resident. Any
other quantisation is refused naming its method. Pure Python.

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
FP8_BLOCK = (128, 128)  # the block SGLang's FP8 MoE and DeepGEMM kernels take (DeepSeek-V3's layout)
SCALE_BYTES = 4  # weight_scale_inv is float32


class GeometryError(ValueError):
    """A config dict the geometry cannot be read from; the message names the key."""


@dataclass(frozen=True)
class WeightQuant:
    """A config's block-FP8 weights: which linear layers are float8_e4m3fn with per-block scales."""

    method: str  # "fp8"
    block: tuple[int, int]  # (block_n over output rows, block_k over input columns)
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers, as the config names them

    def converts(self, module: str) -> bool:
        """Whether `module` (a name such as `self_attn.o_proj` or `mlp.experts`) is FP8: not named in the
        ignore list, for any layer (published lists name the same modules in every layer)."""
        return not any(entry == module or entry.endswith("." + module) for entry in self.not_converted)

    def scale_bytes(self, rows: int, cols: int) -> int:
        """The weight_scale_inv of one [rows, cols] weight (SGLang: ceil(rows/n) x ceil(cols/k) float32)."""
        n, k = self.block
        return -(-rows // n) * -(-cols // k) * SCALE_BYTES

    def describe(self) -> str:
        return f"{self.method} e4m3, {self.block[0]}x{self.block[1]} block scales"


def weight_quant_from_config(config: Mapping[str, Any]) -> WeightQuant | None:
    """None for unquantised weights; block FP8 as DeepSeek-V3's config writes it; GeometryError naming the
    method for any quantisation the planner cannot price (mxfp4, awq, gptq, compressed-tensors, fp8 with
    per-tensor scales or another block)."""
    if config.get("compression_config"):
        raise GeometryError("config key 'compression_config' (compressed-tensors): this quantisation cannot be "
                            "priced; the planner prices unquantised weights and fp8 with 128x128 block scales")
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        raise GeometryError(f"config key 'quantization_config' must be an object (got {quant!r})")
    method = str(quant.get("quant_method", "")).lower()
    unpriced = "the planner prices unquantised weights and fp8 with 128x128 block scales only"
    if method != "fp8":
        raise GeometryError(f"quantization_config.quant_method {method or None!r} cannot be priced: {unpriced}")
    block = quant.get("weight_block_size")
    if block is None:
        raise GeometryError(f"quantization_config: fp8 with per-tensor scales (no weight_block_size) cannot be "
                            f"priced: {unpriced}")
    if list(block) != list(FP8_BLOCK):
        raise GeometryError(f"quantization_config: fp8 with weight_block_size {list(block)} cannot be priced: "
                            f"{unpriced}")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":  # SGLang's Fp8Config refuses block scales with static activations
        raise GeometryError(f"quantization_config: fp8 block scales with activation_scheme {scheme!r}: SGLang "
                            "serves block-quantised fp8 with dynamic activations only")
    ignored = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ()
    return WeightQuant("fp8", FP8_BLOCK, tuple(str(m) for m in ignored))


@dataclass(frozen=True)
class ModelGeometry:
    """One TP rank's share of an MoE model's experts and KV cache."""

    num_layers: int
    moe_layer_ids: tuple[int, ...]
    kv_layer_ids: tuple[int, ...]  # layers that hold a KV cache (all but linear-attention ones)
    local_experts: int  # routed experts per rank: E under TP, E / ep under expert parallelism; no shared ones
    hidden_size: int
    moe_intermediate_per_rank: int  # I / moe_tp, SGLang's moe_tp_size = tp / ep
    kv_heads_per_rank: int
    head_dim: int
    dtype_bytes: int  # the model dtype: KV cache and unquantised weights
    tp_size: int
    expert_quant: WeightQuant | None = None  # block FP8 experts: 1 byte per element, scales resident
    mla_latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim (one latent buffer per layer); 0: K and V
    ep_size: int = 1  # expert parallelism (--ep-size, standard dispatcher): the router picks among E_local * ep

    @property
    def routed_experts(self) -> int:
        """Every routed expert of a layer, over all EP ranks (the router's choice; replicated router weight)."""
        return self.local_experts * self.ep_size

    @property
    def expert_element_bytes(self) -> int:
        return 1 if self.expert_quant else self.dtype_bytes

    @property
    def w13_shard_bytes(self) -> int:
        """One expert's gate+up weight on this rank: [2 * I/tp, H] (the pages VAMP moves; no scales)."""
        return 2 * self.moe_intermediate_per_rank * self.hidden_size * self.expert_element_bytes

    @property
    def w2_shard_bytes(self) -> int:
        """One expert's down weight on this rank: [H, I/tp]."""
        return self.hidden_size * self.moe_intermediate_per_rank * self.expert_element_bytes

    @property
    def expert_scale_bytes_per_layer(self) -> int:
        """Every routed expert's w13 and w2 weight_scale_inv on this rank: resident, never paged."""
        q = self.expert_quant
        if q is None:
            return 0
        i, h = self.moe_intermediate_per_rank, self.hidden_size
        return self.local_experts * (2 * q.scale_bytes(i, h) + q.scale_bytes(h, i))

    @property
    def kv_buffers_per_layer(self) -> int:
        return 1 if self.mla_latent_dim else 2

    @property
    def kv_buffers(self) -> int:
        """Buffers the KV pool keeps (and VAMP grows): K and V per KV layer, or MLA's one latent buffer."""
        return self.kv_buffers_per_layer * len(self.kv_layer_ids)

    @property
    def kv_row_bytes(self) -> int:
        """One token's row in one buffer on this rank: K (or V) heads * head_dim, or the whole MLA latent."""
        if self.mla_latent_dim:
            return self.mla_latent_dim * self.dtype_bytes
        return self.kv_heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's KV over every KV layer on this rank (SGLang's cell size)."""
        return self.kv_buffers * self.kv_row_bytes

    @property
    def expert_bytes_per_layer(self) -> int:
        """Routed-expert memory of one MoE layer on this rank: weights and their resident scales."""
        return self.local_experts * (self.w13_shard_bytes + self.w2_shard_bytes) + self.expert_scale_bytes_per_layer


def geometry_from_config(config: Mapping[str, Any], tp_size: int, dtype: str, ep_size: int = 1) -> ModelGeometry:
    """Read a Qwen2/Qwen3-MoE, Qwen3-Next, Mixtral or DeepSeek-V2/V3 config dict for one rank of `tp_size`.
    `ep_size` > 1 (SGLang's --ep-size with the standard dispatcher): each rank holds E / ep routed experts
    (SGLang asserts ep divides them, layers/moe/fused_moe_triton/layer.py:414), split on the intermediate size
    over moe_tp = tp / ep ranks (runtime_context.py:154); attention and KV keep the TP split."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise GeometryError(f"tp_size must be a positive integer (got {tp_size!r})")
    if not isinstance(ep_size, int) or ep_size < 1 or tp_size % ep_size:
        raise GeometryError(f"ep_size {ep_size!r} must divide tp_size {tp_size} (SGLang's moe_tp_size = tp / ep)")
    if dtype not in DTYPE_BYTES:
        raise GeometryError(f"dtype must be one of {', '.join(DTYPE_BYTES)} (got {dtype!r})")
    quant = weight_quant_from_config(config)
    layers = config_int(config, "num_hidden_layers")
    hidden = config_int(config, "hidden_size")
    if "num_local_experts" in config:  # Mixtral: every layer is MoE, experts use intermediate_size
        experts, inter = config_int(config, "num_local_experts"), config_int(config, "intermediate_size")
        moe_ids = tuple(range(layers))
    elif "n_routed_experts" in config:  # DeepSeek-V2/V3, Kimi-K2: dense first layers, then MoE
        experts, inter = config_int(config, "n_routed_experts"), config_int(config, "moe_intermediate_size")
        moe_ids = deepseek_moe_layers(config, layers)
    else:
        experts, inter = config_int(config, "num_experts"), config_int(config, "moe_intermediate_size")
        moe_ids = _qwen_moe_layers(config, layers)
    if experts % ep_size:
        raise GeometryError(f"ep_size {ep_size} does not divide the {experts} routed experts; SGLang "
                            "requires every EP rank to hold the same number")
    moe_tp = tp_size // ep_size
    if inter % moe_tp:
        raise GeometryError(f"moe intermediate size {inter} is not divisible by tp_size {tp_size}"
                            + (f" / ep_size {ep_size}" if ep_size > 1 else ""))
    expert_quant = quant if quant and quant.converts("mlp.experts") else None
    if expert_quant and (inter // moe_tp) % expert_quant.block[0]:
        split = f"--tp {tp_size}" + (f" --ep {ep_size}" if ep_size > 1 else "")
        raise GeometryError(f"{split}: the FP8 experts' intermediate size per rank {inter // moe_tp} "
                            f"({inter}/{moe_tp}) is not a multiple of the {expert_quant.block[0]}-wide scale "
                            "block; SGLang refuses this split for block-quantised experts")
    if config.get("kv_lora_rank"):  # MLA: one latent KV row per token and layer, whole on every rank
        latent = config_int(config, "kv_lora_rank") + config_int(config, "qk_rope_head_dim")
        kv_heads, head_dim = 1, latent
    else:
        latent = 0
        kv_heads = kv_heads_per_rank(config, tp_size)
        head_dim = int(config.get("head_dim") or hidden // config_int(config, "num_attention_heads"))
    return ModelGeometry(
        num_layers=layers, moe_layer_ids=moe_ids, kv_layer_ids=_kv_layers(config, layers),
        local_experts=experts // ep_size, hidden_size=hidden, moe_intermediate_per_rank=inter // moe_tp,
        kv_heads_per_rank=kv_heads, head_dim=head_dim, dtype_bytes=DTYPE_BYTES[dtype], tp_size=tp_size,
        expert_quant=expert_quant, mla_latent_dim=latent, ep_size=ep_size)


def kv_heads_per_rank(config: Mapping[str, Any], attn_tp_size: int) -> int:
    """KV heads one attention-TP rank holds (replicated when there are fewer heads than ranks). DP attention
    splits them over attention-TP (tp / dp) while the experts keep the tp / ep split, so the planner asks for
    the heads alone, without the expert split checks of `geometry_from_config`."""
    if config.get("kv_lora_rank"):
        return 1  # MLA: one latent row per token and layer, whole on every rank
    return max(1, config_int(config, "num_key_value_heads") // attn_tp_size)


def _qwen_moe_layers(config: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Hugging Face's rule: MoE unless in mlp_only_layers, every decoder_sparse_step-th layer."""
    step = int(config.get("decoder_sparse_step", 1))
    mlp_only = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)


def deepseek_moe_layers(config: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """SGLang's DeepseekV2DecoderLayer rule: MoE from first_k_dense_replace on, every moe_layer_freq-th."""
    first = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    return tuple(i for i in range(layers) if i >= first and i % freq == 0)


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


def config_int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise GeometryError(f"config key {key!r} must be a positive integer (got {value!r})")
    return value


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
    buffers = geo.kv_buffers
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
          f"({len(geo.moe_layer_ids) - 1} eligible), {len(geo.kv_layer_ids)} KV layers ({geo.kv_buffers} buffers), "
          f"{PAGE_BYTES >> 20} MiB pages")
    print(f"{'ratio':>6} {'groups':>6} {'reclaimed GiB/GPU':>17} {'pool GiB/GPU':>12}")
    print(f"{0:>6} {0:>6} {0.0:>17.2f} {args.kv_pool_gib:>12.2f}")
    for row in rows:
        print(f"{row.ratio:>6} {row.offloaded_groups:>6} {row.reclaimed_bytes / GIB:>17.2f} "
              f"{row.kv_pool_bytes / GIB:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
