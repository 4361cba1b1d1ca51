"""What each offload ratio VAMP-r buys (KV pool) and costs (expert bytes staged per decode step).

Per TP rank, from the model config and the deployment, with the same geometry and layout code the
server runs (vamp_sglang.memory.geometry / layout):

- baseline pool: what the static memory budget (GPU memory x mem fraction, SGLang's
  `--mem-fraction-static`) leaves after the weights, or a measured pool, capped by SGLang's
  `--max-total-tokens` and rounded to its `--page-size`;
- at ratio r: the layout's offload bound for VAMP-r (paper IV-C, staging slot as large as the bound,
  as the server allocates it) gives the groups offloaded from every eligible layer; their pages are
  the reclaimed bytes (Table II), split evenly over the K and V buffers (V-A; MLA: the one latent
  buffer per layer), and the pool grows by the whole rows those pages hold, exactly as the server's
  KV buffers grow. With block-FP8 experts the pages are the 1-byte weights; their float32 block
  scales stay resident (counted in the expert bytes, never reclaimed or staged);
- staged bytes per decode step: the whole offloaded region of every eligible layer is copied in
  before its MoE kernel, whatever the router picks (paper IV-D), i.e. the reclaimed bytes; the TPOT
  bound is max(decode step time, staged bytes / host-to-device bandwidth).

Under DP attention (`dp` > 1, SGLang's `--enable-dp-attention --dp-size dp`) each DP rank has its own pool and
the attention layers split over its attention-TP group (tp / dp ranks), the experts over the whole TP group. A
KV row is then replicated only within that group: MLA's latent is whole on every rank either way, so with
attention-TP 1 each rank's pool holds tokens no other rank holds and the deployment holds dp times one pool
(`deployment_tokens`), where under TP every rank holds the same tokens. MHA's KV heads split over attention-TP
only. Each rank also holds more attention weights (every head at attention-TP 1), which the start-up pool pays.

Under expert parallelism (`ep` > 1, SGLang's `--ep-size` with the standard dispatcher, `--moe-a2a-backend none`)
each rank holds E / ep routed experts split on the intermediate size over tp / ep ranks (whole experts at
ep = tp), so an offloaded group is fewer, wider experts; VAMP pages and stages only the rank's own experts, so
the reclaimed and staged bytes and the tokens they buy are per rank exactly as under TP. Attention, the pool and
the shared experts keep the TP (or DP attention) split.

Arithmetic only: nothing here touches torch or SGLang.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vamp_sglang.capacity.draft import DraftPlan, draft_plan
from vamp_sglang.capacity.weights import dense_weight_bytes
from vamp_sglang.memory.geometry import GeometryError, ModelGeometry, geometry_from_config, kv_heads_per_rank
from vamp_sglang.memory.layout import ExpertLayout, kv_pages_per_buffer, kv_rows_for_bytes, pages_for_rows

GIB = 1 << 30
PAGE_BYTES = 2 << 20  # CUDA VMM granularity on current GPUs; the host page backend uses the same


class CapacityError(ValueError):
    """A deployment the planner cannot size; the message names the flag."""


@dataclass(frozen=True)
class Deployment:
    """The GPUs and serving flags a plan is for (one value per TP rank: ranks are identical)."""

    gpu_mem_gib: float
    tp: int
    dtype: str
    mem_fraction: float = 0.9  # share of GPU memory for weights + KV pool (paper: 0.90 at engine start)
    h2d_gbps: float = 50.0  # host-to-device copy bandwidth, GB/s (1e9 B/s): PCIe 5.0 x16, pinned
    decode_ms: float = 0.0  # decode step time with every expert resident (0: staging alone bounds TPOT)
    page_size: int = 1  # SGLang --page-size: the KV allocator's page, in tokens
    max_total_tokens: int | None = None  # SGLang --max-total-tokens
    kv_pool_gib: float | None = None  # a measured start-up pool per GPU, instead of the estimate
    page_bytes: int = PAGE_BYTES
    dp: int = 1  # DP attention degree (--enable-dp-attention --dp-size); 1: none
    ep: int = 1  # expert parallelism (--ep-size, standard dispatcher); 1: none
    speculative_algorithm: str | None = None  # NEXTN, EAGLE or EAGLE3 (capacity/draft.py); None: no draft
    draft_model_path: str | None = None  # --speculative-draft-model-path: a draft config.json or built-in name

    @property
    def attn_tp(self) -> int:
        """The attention-TP group: the ranks that share one DP rank's pool (and replicate its KV rows)."""
        return self.tp // self.dp

    @property
    def pools(self) -> int:
        """Pools holding distinct tokens: one per DP rank (under plain TP every rank holds the same)."""
        return self.dp


@dataclass(frozen=True)
class Baseline:
    expert_bytes: int  # routed-expert weights on one rank, with their resident FP8 block scales
    dense_bytes: int  # every other weight on one rank
    tokens: int  # SGLang's pool size at start (max_total_num_tokens)
    pages_per_buffer: int  # pages each K or V buffer maps at start
    source: str  # "estimate", "measured" or "max-total-tokens"


@dataclass(frozen=True)
class RatioPlan:
    ratio: float
    offloaded_groups: int  # per eligible layer
    reclaimed_bytes: int  # expert bytes unmapped on one rank (the server's experts.reclaimed_bytes)
    kv_pool_bytes: int  # physical KV pool on one rank: every K and V buffer's mapped pages
    kv_pool_tokens: int  # SGLang's pool size after the offload (the server's kv_pool.tokens)
    staged_bytes_per_step: int  # copied host-to-device per decode step on one rank
    staging_ms: float  # staged bytes / bandwidth
    tpot_bound_ms: float  # max(decode step, staging)


@dataclass(frozen=True)
class CapacityModel:
    """One model on one deployment: the geometry, the start-up pool, and a plan per ratio."""

    geometry: ModelGeometry
    deployment: Deployment
    baseline: Baseline
    draft: DraftPlan | None = None  # speculative decoding's draft: its rows grow with the target's

    @classmethod
    def build(cls, config: Mapping[str, Any], deployment: Deployment) -> CapacityModel:
        d = deployment
        if d.dp < 1 or d.tp % d.dp:
            raise CapacityError(f"--dp {d.dp} must divide --tp {d.tp} (DP attention splits the TP ranks into "
                                "DP ranks of tp / dp attention-TP ranks each)")
        if d.ep < 1 or d.tp % d.ep:
            raise CapacityError(f"--ep {d.ep} must divide --tp {d.tp} (SGLang splits each expert over tp / ep "
                                "ranks)")
        try:
            geo = geometry_from_config(config, d.tp, d.dtype, d.ep)
        except GeometryError as exc:
            if d.ep > 1 and "routed experts" in str(exc):
                raise CapacityError(f"--ep {d.ep}: {exc}") from None
            raise
        if d.dp > 1 and not geo.mla_latent_dim:  # KV heads split over attention-TP only
            geo = dataclasses.replace(geo, kv_heads_per_rank=kv_heads_per_rank(config, d.attn_tp))
        expert = geo.expert_bytes_per_layer * len(geo.moe_layer_ids)
        dense = dense_weight_bytes(config, d.tp, d.dtype, d.attn_tp, d.ep)
        draft = None if d.speculative_algorithm is None else draft_plan(
            d.speculative_algorithm, d.draft_model_path, config, geo, d.dtype, d.attn_tp, d.ep, d.dp)
        draft_weights = draft.weight_bytes if draft else 0
        kv_token = geo.kv_bytes_per_token + (draft.kv_bytes_per_token if draft else 0)
        if d.kv_pool_gib is not None:
            tokens, source = math.floor(d.kv_pool_gib * GIB / kv_token), "measured"
        else:
            budget = d.gpu_mem_gib * GIB * d.mem_fraction
            weights = expert + dense + draft_weights
            if budget <= weights:
                raise CapacityError(
                    f"--gpu-mem-gib {d.gpu_mem_gib} x --mem-fraction {d.mem_fraction} = {budget / GIB:.2f} GiB "
                    f"does not hold the weights ({weights / GIB:.2f} GiB per GPU at --tp {d.tp})")
            rest = budget - weights
            if draft is not None:  # a hybrid model's draft state shrinks SGLang's state share, not the pool
                draft = draft.sized(rest, d.dp)
                rest += draft.split.kv_gain_bytes if draft.split else 0
            tokens, source = math.floor(rest / kv_token), "estimate"
        if d.max_total_tokens is not None and d.max_total_tokens < tokens:
            tokens, source = d.max_total_tokens, "max-total-tokens"
        tokens -= tokens % d.page_size  # SGLang rounds the pool down to whole allocator pages
        if tokens <= 0:
            raise CapacityError(f"the KV pool at start holds no {d.page_size}-token page")
        pages = pages_for_rows(tokens + d.page_size, geo.kv_row_bytes, d.page_bytes, d.page_size)
        return cls(geo, d, Baseline(expert, dense, tokens, pages, source), draft)

    @property
    def kv_buffers(self) -> int:
        """One K and one V buffer per layer that holds a KV cache, or MLA's one latent buffer per layer
        (paper V-A splits the reclaimed pages over them), and the draft's, which grow with them."""
        return self.geometry.kv_buffers + (self.draft.kv_buffers if self.draft else 0)

    @property
    def kv_bytes_per_token(self) -> int:
        """SGLang's cell: the target's KV bytes per token and the draft layers' (paper IV-C's c, draft counted)."""
        return self.geometry.kv_bytes_per_token + (self.draft.kv_bytes_per_token if self.draft else 0)

    def layout(self, ratio: float) -> ExpertLayout:
        geo = self.geometry
        return ExpertLayout.compute(geo.moe_layer_ids, geo.local_experts, geo.w13_shard_bytes, geo.w2_shard_bytes,
                                    self.deployment.page_bytes, ratio, staging_capacity_shards=geo.local_experts)

    def pool_tokens(self, extra_pages_per_buffer: int) -> int:
        """SGLang's pool size once every buffer maps this many pages more than at start: the start-up
        size plus the whole rows gained (the spare rows of the start-up pages stay unused)."""
        d, b, row = self.deployment, self.baseline, self.geometry.kv_row_bytes
        start_rows = kv_rows_for_bytes(b.pages_per_buffer * d.page_bytes, row, d.page_size)
        rows = kv_rows_for_bytes((b.pages_per_buffer + extra_pages_per_buffer) * d.page_bytes, row, d.page_size)
        return b.tokens + rows - start_rows

    def plan(self, ratio: float) -> RatioPlan:
        d = self.deployment
        lay = self.layout(ratio)
        groups = lay.bound_groups
        extra_pages = kv_pages_per_buffer(groups, lay.pages_freed_per_group, self.kv_buffers)
        reclaimed = groups * lay.bytes_freed_per_group
        staging_ms = reclaimed / (d.h2d_gbps * 1e9) * 1e3
        return RatioPlan(
            ratio=ratio, offloaded_groups=groups, reclaimed_bytes=reclaimed,
            kv_pool_bytes=(self.baseline.pages_per_buffer + extra_pages) * self.kv_buffers * d.page_bytes,
            kv_pool_tokens=self.pool_tokens(extra_pages), staged_bytes_per_step=reclaimed,
            staging_ms=staging_ms, tpot_bound_ms=max(d.decode_ms, staging_ms))
