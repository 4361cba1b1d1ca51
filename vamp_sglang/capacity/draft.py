"""The draft model of speculative decoding in the capacity plan: its KV rows and its weights, per TP rank.

Why: SGLang 0.5.23 builds the draft's KV pool with the target's row count and allocator, so one pool size
holds target and draft rows alike. It sizes that pool with the draft's layers in the cell, assuming the
draft's rows equal the target's (model_executor/pool_configurator.py:259-314: cell x (1 + draft layers /
target KV layers)), and it loads the draft's weights before sizing it (managers/scheduler.py:1128-1137;
mem_cache/kv_cache_configurator.py:3042 "Loaded weights (target + draft)"). VAMP then grows the draft's
buffers with the target's (integration/memory/draft_pools.py), so an offloaded group's pages split over
the target's and the draft's buffers together, and a group buys fewer tokens than without a draft.

What the draft is, as SGLang resolves it (model_runner_components/spec_aux_hidden_state.py:131-178):
- NEXTN, or EAGLE without `--speculative-draft-model-path`: the target's own MTP layers
  (`num_nextn_predict_layers`; DeepSeek-V3/R1 and GLM-4.5/4.6: one). Each is one more decoder layer of the
  target's kind (DeepSeek: MLA and an MoE layer with every routed expert, which VAMP keeps resident: the
  draft runs it every step and it is not paged), plus `eh_proj` [H, 2H] (a plain nn.Linear in the model dtype,
  models/deepseek_nextn.py:102) and its own embedding and LM head, held until the draft shares the target's
  after the pool is sized (speculative/eagle_worker_v2.py:258, deepseek_v2.py set_embed_and_head).
- NEXTN, or EAGLE without a draft path, on Qwen3-Next (hybrid: Gated DeltaNet and full attention): its one MTP
  layer (SGLang sets num_nextn_predict_layers 1, configs/model_config.py:1134-1136), built as a one-layer
  Qwen3NextModel with full_attention_interval 1 (models/qwen3_next_mtp.py:57-78): one full-attention layer,
  whose KV sits in the attention pool's cell and grows with it, and a MoE layer whose routed experts stay
  resident; `mtp.fc` [H, 2H] (a plain nn.Linear) and its own embedding and head until sizing, as DeepSeek's.
  Its verify keeps each draft token's linear-attention state (intermediate_ssm, intermediate_conv_window),
  one row per running request, not per state slot (mem_cache/kv_cache_configurator.py:1718-1721). On SGLang's
  default sizing (no --max-mamba-cache-size, as VAMP launches it) that state comes out of the state share, not
  the KV pool (`StateSplit`), and the pool gains what the share no longer holds. Other drafts on a hybrid
  model are refused in the launcher's words (refusals/hybrid.py).
- EAGLE or EAGLE3 with a draft path: a Llama draft of `num_hidden_layers` layers (models/llama_eagle.py,
  llama_eagle3.py): an embedding (shared after sizing), `fc` (EAGLE: 2H -> H; EAGLE3: one target hidden
  state per auxiliary layer, three by default, -> H), the layers (EAGLE3's first reads [embedding, hidden]:
  2H wide into qkv), and an LM head over `draft_vocab_size`.
Arithmetic only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vamp_sglang.capacity.models import config_file, read_config
from vamp_sglang.capacity.weights import dense_weight_bytes
from vamp_sglang.memory.geometry import (
    DTYPE_BYTES,
    ModelGeometry,
    config_int,
    geometry_from_config,
    kv_heads_per_rank,
)
from vamp_sglang.refusals import hybrid as hybrid_refusals
from vamp_sglang.refusals.speculative import kv_row_mismatch

ALGORITHM = "--speculative-algorithm"
DRAFT_PATH = "--speculative-draft-model-path"
ALGORITHMS = ("NEXTN", "EAGLE", "EAGLE3")  # the draft algorithms VAMP serves (refusals/speculative.py)

# What sizes a hybrid model's per-draft-token state, at SGLang's defaults: max_running_requests with a draft
# (arg_groups/speculative_hook.py:1086-1094), Qwen3-Next's automatic chain of 3 steps at top-k 1, 4 draft tokens
# (speculative_hook.py:1161-1174, 1430-1480), and the state dtypes (configs/mamba_utils.py:47-104: the conv
# window bfloat16 unless SGLANG_MAMBA_CONV_DTYPE, the recurrent state float32 unless the config's mamba_ssm_dtype).
RUNNING_REQUESTS = 48
DRAFT_TOKENS = 4
CONV_STATE_BYTES = 2
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# SGLang's default state share, --mamba-full-memory-ratio's fallback (arg_groups/fields/schedule.py:220-227),
# and the state slots a running request may hold with the radix cache on and the no_buffer strategy VAMP
# launches with (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO, kv_cache_configurator.py:227, 3062-3088;
# refusals/hybrid.py vamp_defaults).
STATE_SHARE = 0.9
SLOTS_PER_REQUEST = 3

# Built-in draft configs, as published. qwen3-235b-a22b-eagle3: the EAGLE3 head SGLang's cookbook serves for
# Qwen3-235B-A22B (lmsys/Qwen3-235B-A22B-EAGLE3), SpecForge's configs/qwen3-235B-A22B-eagle3.json.
DRAFTS: dict[str, dict[str, Any]] = {
    "qwen3-235b-a22b-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": 4096, "intermediate_size": 24576, "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 151936, "draft_vocab_size": 32000, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 46, 90], "use_aux_hidden_state": True},
        "torch_dtype": "bfloat16"},
}


class DraftError(ValueError):
    """A draft the planner cannot price; the message names the flag."""


@dataclass(frozen=True)
class StateSplit:
    """How SGLang's default sizing (kv_cache_configurator.py:3345-3386, 3404-3409) splits the memory left
    after the weights, `rest`, for a hybrid model with a draft. The state share is rest x r / (1 + r) (r = 0.9).
    Without a draft it holds K0 = share / per_req - 1 slots (and a padding slot). With one, SGLang solves the
    slots K and the per-draft-token state of K / 3 requests jointly,
    K = (share - per_req (1 + D)) / (per_req (1 + D / 3)), but allocates that state for
    min(running requests, K / 3) + 1 only and returns the rest to the KV pool:
    KV = rest - per_req (running + 1) D - per_req (K + 1). So the draft's state shrinks the slots, not the
    pool, and the pool gains per_req (K0 - K) - per_req (running + 1) D over a server without a draft."""

    slots: int  # state slots with the draft (SGLang's max_mamba_cache_size)
    slots_without_draft: int
    reserve_bytes: int  # the per-draft-token state SGLang allocates
    kv_gain_bytes: int  # what the KV pool gets over a server without a draft, at the same memory

    @classmethod
    def solve(cls, rest_bytes: float, per_request: int, dp: int) -> StateSplit:
        share = rest_bytes * STATE_SHARE / (1 + STATE_SHARE)
        plain = int((share - per_request) // per_request)
        slots = int((share - per_request * (1 + DRAFT_TOKENS))
                    // (per_request * (1 + DRAFT_TOKENS / SLOTS_PER_REQUEST)))
        if slots <= 0:  # SGLang stops at start (kv_cache_configurator.py:3388-3402)
            raise DraftError(f"{ALGORITHM} on a hybrid model: {rest_bytes / (1 << 30):.2f} GiB after the "
                             "weights leaves SGLang's state share no state slot beside the per-draft-token "
                             "state; raise --gpu-mem-gib or --mem-fraction")
        running = min(max(1, RUNNING_REQUESTS // dp), slots // SLOTS_PER_REQUEST)
        reserve = per_request * (running + 1) * DRAFT_TOKENS
        return cls(slots, plain, reserve, (plain - slots) * per_request - reserve)


@dataclass(frozen=True)
class DraftPlan:
    """One TP rank's share of the draft: what it adds to the pool's cell and buffers, and its weights."""

    algorithm: str
    layers: int  # draft KV layers (SGLang's eagle_draft_num_layers)
    kv_buffers: int  # draft buffers VAMP grows with the target's (MLA: one a layer; K and V otherwise)
    kv_bytes_per_token: int  # what SGLang adds to the cell: target cell x draft layers / target KV layers
    weight_bytes: int  # every draft weight on this rank when the pool is sized
    expert_bytes: int  # the part of weight_bytes in routed experts: resident, never offloaded
    source: str  # "mtp" (the target's own layers), a built-in draft name or a config.json path
    state_bytes: int = 0  # a hybrid model's per-draft-token state at 48 running requests (StateSplit)
    state_per_request: int = 0  # a hybrid model's linear-attention state per request (SGLang's per_req)
    split: StateSplit | None = None  # how SGLang's default sizing fits the state, once the memory is known

    def sized(self, rest_bytes: float, dp: int) -> DraftPlan:
        """This draft on a start-up budget of `rest_bytes` after the weights: a hybrid model's state split."""
        if not self.state_per_request:
            return self
        split = StateSplit.solve(rest_bytes, self.state_per_request, dp)
        return dataclasses.replace(self, state_bytes=split.reserve_bytes, split=split)

    def to_json(self) -> dict[str, Any]:
        split = self.split
        return {"algorithm": self.algorithm, "layers": self.layers, "kv_buffers": self.kv_buffers,
                "kv_bytes_per_token": self.kv_bytes_per_token, "weight_bytes_per_gpu": self.weight_bytes,
                "expert_bytes_per_gpu": self.expert_bytes, "state_bytes_per_gpu": self.state_bytes,
                "state_slots_per_gpu": split.slots if split else None,
                "state_slots_without_draft": split.slots_without_draft if split else None,
                "kv_bytes_from_state_share": split.kv_gain_bytes if split else 0, "source": self.source}


def check_flags(algorithm: str | None, draft_path: str | None) -> None:
    """The flag combinations SGLang would serve: EAGLE3 needs a draft; NEXTN reads the target's MTP layers."""
    if draft_path and not algorithm:
        raise DraftError(f"{DRAFT_PATH} needs {ALGORITHM} (EAGLE or EAGLE3)")
    if algorithm == "EAGLE3" and not draft_path:
        raise DraftError(f"{ALGORITHM} EAGLE3 needs {DRAFT_PATH}: the draft's config.json, or a built-in draft "
                         f"({', '.join(DRAFTS)})")
    if algorithm == "NEXTN" and draft_path:
        raise DraftError(f"{ALGORITHM} NEXTN runs the target's own MTP layers; drop {DRAFT_PATH} (or use EAGLE)")


def load_draft_config(draft_path: str) -> tuple[str, dict[str, Any]]:
    """(source, config) of a draft: a config.json, a directory holding one, or a built-in draft name."""
    file = config_file(draft_path)
    if file.is_file():
        return str(file), read_config(file, f"{DRAFT_PATH} {draft_path}")
    if draft_path.lower().rsplit("/", 1)[-1] in DRAFTS:
        key = draft_path.lower().rsplit("/", 1)[-1]
        return key, json.loads(json.dumps(DRAFTS[key]))
    raise DraftError(f"{DRAFT_PATH} {draft_path!r} is neither a config.json (or a directory holding one) nor a "
                     f"built-in draft ({', '.join(DRAFTS)})")


def draft_plan(algorithm: str, draft_path: str | None, config: Mapping[str, Any], geo: ModelGeometry,
               dtype: str, attn_tp: int, ep: int, dp: int = 1) -> DraftPlan:
    """The draft `algorithm` (and `draft_path`) add to a target of geometry `geo` on one rank (of `dp` DP
    attention ranks)."""
    check_flags(algorithm, draft_path)
    if len(geo.kv_layer_ids) != geo.num_layers:
        return _hybrid_mtp_plan(algorithm, draft_path, config, geo, dtype, attn_tp, ep, dp)
    if draft_path is None:
        layers = int(config.get("num_nextn_predict_layers") or 0)
        if layers < 1:
            raise DraftError(f"{ALGORITHM} {algorithm} without {DRAFT_PATH} runs the model's MTP layers, and this "
                             "model has none (num_nextn_predict_layers 0); pass an EAGLE draft")
        return _mtp_plan(algorithm, config, layers, geo, dtype, attn_tp, ep, "mtp")
    source, draft = load_draft_config(draft_path)
    if why := kv_row_mismatch(draft, config, attn_tp):
        raise DraftError(f"{DRAFT_PATH} {draft_path}: {why}")
    if draft.get("kv_lora_rank"):  # an MLA draft: a NextN checkpoint (DeepSeek's MTP layer as an EAGLE draft)
        layers = int(draft.get("num_nextn_predict_layers") or config_int(draft, "num_hidden_layers"))
        return _mtp_plan(algorithm, draft, layers, geo, dtype, attn_tp, ep, source)
    layers = config_int(draft, "num_hidden_layers")
    weights = _llama_draft_bytes(draft, geo.hidden_size, geo.tp_size, attn_tp, DTYPE_BYTES[dtype],
                                 eagle3=algorithm == "EAGLE3")
    return DraftPlan(algorithm, layers, 2 * layers, _sglang_draft_cell(geo, layers), weights, 0, source)


def _sglang_draft_cell(geo: ModelGeometry, layers: int) -> int:
    """pool_configurator.py:311: int(cell x draft layers / target KV layers)."""
    return geo.kv_bytes_per_token * layers // len(geo.kv_layer_ids)


def _mtp_plan(algorithm: str, layer_config: Mapping[str, Any], layers: int, geo: ModelGeometry, dtype: str,
              attn_tp: int, ep: int, source: str) -> DraftPlan:
    """`layers` MTP layers of `layer_config` (the target's own, or a NextN checkpoint's, whose layer count is
    SGLang's num_nextn_predict_layers, spec_aux_hidden_state.py:156-174): each priced as one more decoder
    layer after the target's (the same MoE layer rule; SGLang builds it with is_nextn, deepseek_v2.py:2785,
    so DeepSeek's is a MoE layer), with eh_proj and the draft's own embedding and head. Its KV is the
    target's row (equal rows, checked): MLA's one latent buffer a layer."""
    base = {**layer_config, "num_hidden_layers": geo.num_layers}
    more = {**layer_config, "num_hidden_layers": geo.num_layers + layers}
    geo_base = geometry_from_config(base, geo.tp_size, dtype, ep)
    geo_more = geometry_from_config(more, geo.tp_size, dtype, ep)
    experts = (len(geo_more.moe_layer_ids) - len(geo_base.moe_layer_ids)) * geo_more.expert_bytes_per_layer
    layer_bytes = dense_weight_bytes(more, geo.tp_size, dtype, attn_tp, ep) \
        - dense_weight_bytes(base, geo.tp_size, dtype, attn_tp, ep)
    element, hidden = DTYPE_BYTES[dtype], geo.hidden_size
    embed_head = 2 * (config_int(layer_config, "vocab_size") * hidden // geo.tp_size * element)
    weights = experts + layer_bytes + layers * 2 * hidden * hidden * element + embed_head  # eh_proj [H, 2H]
    return DraftPlan(algorithm, layers, layers * geo.kv_buffers_per_layer, _sglang_draft_cell(geo, layers),
                     weights, experts, source)


def _hybrid_mtp_plan(algorithm: str, draft_path: str | None, config: Mapping[str, Any], geo: ModelGeometry,
                     dtype: str, attn_tp: int, ep: int, dp: int) -> DraftPlan:
    """Qwen3-Next's MTP layer, priced as SGLang builds it: a one-layer model of the target's config with
    full_attention_interval 1 (its embedding and head are that model's, held until sizing), plus `mtp.fc`;
    its KV is one of the target's attention layers in the cell (pool_configurator.py:311); and the
    per-draft-token state its verify keeps for every running request (split from the state share once the
    memory after the weights is known, `DraftPlan.sized`)."""
    if algorithm not in hybrid_refusals.MTP_DRAFTS:
        raise DraftError(hybrid_refusals.message("speculative"))
    if config.get("model_type") != "qwen3_next":
        raise DraftError(f"{ALGORITHM} {algorithm} on a {config.get('model_type')} hybrid model: the planner "
                         "prices Qwen3-Next's MTP layer only")
    if draft_path is not None:
        raise DraftError(f"{DRAFT_PATH} on a hybrid model: the planner prices the model's own MTP layer "
                         f"({ALGORITHM} NEXTN, or EAGLE without {DRAFT_PATH})")
    layer = {**config, "num_hidden_layers": 1, "full_attention_interval": 1, "layer_types": ["full_attention"],
             "tie_word_embeddings": False}
    experts = geometry_from_config(layer, geo.tp_size, dtype, ep).expert_bytes_per_layer
    fc = 2 * geo.hidden_size * geo.hidden_size * DTYPE_BYTES[dtype]
    weights = experts + dense_weight_bytes(layer, geo.tp_size, dtype, attn_tp, ep) + fc
    rows = max(1, RUNNING_REQUESTS // dp) + 1  # the running requests of this DP rank and a padding row
    per_request = _state_bytes_per_request(config, geo.num_layers - len(geo.kv_layer_ids), attn_tp)
    return DraftPlan(algorithm, 1, geo.kv_buffers_per_layer, _sglang_draft_cell(geo, 1), weights, experts, "mtp",
                     per_request * rows * DRAFT_TOKENS, per_request)


def _state_bytes_per_request(config: Mapping[str, Any], linear_layers: int, attn_tp: int) -> int:
    """SGLang's mamba_cache_per_req for Gated DeltaNet on one attention-TP rank (configs/qwen3_next.py:288-313,
    configs/mamba_utils.py:116-127, 193-241): a conv window of (kernel - 1) over q, k and v (key groups
    replicated up to the ranks when fewer), and a recurrent state of value heads x value dim x key dim."""
    key_heads, key_dim = config_int(config, "linear_num_key_heads"), config_int(config, "linear_key_head_dim")
    value_heads, value_dim = config_int(config, "linear_num_value_heads"), config_int(config, "linear_value_head_dim")
    groups = key_heads if key_heads % attn_tp == 0 else attn_tp
    conv_dim = value_heads * value_dim + 2 * groups * key_dim
    conv = conv_dim // attn_tp * (int(config.get("linear_conv_kernel_dim", 4)) - 1) * CONV_STATE_BYTES
    state = STATE_DTYPE_BYTES.get(str(config.get("mamba_ssm_dtype")), 4)
    return linear_layers * (conv + value_heads // attn_tp * value_dim * key_dim * state)


def _llama_draft_bytes(draft: Mapping[str, Any], target_hidden: int, tp: int, attn_tp: int, element: int,
                       eagle3: bool) -> int:
    """A Llama EAGLE/EAGLE3 draft on one rank, in the model dtype: embedding and LM head vocab-parallel, qkv
    and gate/up column-parallel, o and down row-parallel, fc replicated (a plain nn.Linear)."""
    hidden, layers = config_int(draft, "hidden_size"), config_int(draft, "num_hidden_layers")
    heads, inter = config_int(draft, "num_attention_heads"), config_int(draft, "intermediate_size")
    head_dim = int(draft.get("head_dim") or hidden // heads)
    kv_rows = kv_heads_per_rank(draft, attn_tp) * head_dim  # KV heads replicated below attn-TP
    vocab = config_int(draft, "vocab_size")
    draft_vocab = int(draft.get("draft_vocab_size") or vocab)
    aux = len((draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (0, 0, 0))
    fc_in = int(draft.get("target_hidden_size") or target_hidden) * aux if eagle3 else 2 * hidden
    total = vocab * hidden // tp + draft_vocab * hidden // tp + fc_in * hidden
    for layer in range(layers):
        width = 2 * hidden if eagle3 and layer == 0 else hidden
        total += (heads * head_dim // attn_tp + 2 * kv_rows) * width + hidden * heads * head_dim // attn_tp
        total += 3 * inter * hidden // tp
    return total * element
