"""Expert layout: which expert bytes can leave, in what units, and what they buy in KV tokens.

Paper section IV-C / V-A: pages move between the expert weights and the KV pool in *expert groups*,
the fewest consecutive rank-local expert shards whose bytes are whole allocation pages, so a group's
pages can be unmapped from the expert tensor and mapped at the KV tail unchanged. Within each
offload-eligible MoE layer a low-index region stays resident and a contiguous high-index region is
offloaded; the boundary moves uniformly across eligible layers. The first MoE layer stays resident
(section V-B: it has no earlier MoE computation to hide its staging copy behind).

Groups are counted from the TOP of the routed expert range (experts [R - G*g, R)), so R need not be a
multiple of g: the leading R mod g experts simply never leave. R is E less the fused shared experts:
where SGLang fuses a model's shared expert into the MoE kernel (Qwen3-Next on CUDA) it stores it as the
last local expert(s) and every token selects it, so those rows stay resident above the groups. Both w13 and w2 slices of a group must be whole
pages, because the two weights live in separate tensors (separate reservations).

Pure arithmetic: no torch, so the planner and the benchmark can use it without a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class LayoutError(ValueError):
    """Bad layout input; the message names the field."""


@dataclass(frozen=True)
class ExpertLayout:
    """The per-rank expert geometry the repartitioner, staging and planner share (paper IV-C, V-A)."""

    moe_layer_ids: tuple[int, ...]  # every MoE layer, in forward order
    local_experts: int  # E: rank-local expert shards per layer
    w13_shard_bytes: int  # one expert's gate+up slice on this rank
    w2_shard_bytes: int  # one expert's down slice on this rank
    granularity_bytes: int  # page size of the backend (CUDA VMM allocation granularity)
    max_offload_ratio: float  # VAMP-r: at most this fraction of E may leave an eligible layer
    staging_capacity_shards: int  # E_buffer: expert shards one staging slot can hold
    group_experts: int  # g
    groups_per_layer: int  # G = E // g, counted from the top of the expert range
    bound_groups: int  # max offloadable groups per eligible layer
    fused_shared_experts: int = 0  # the top local experts: SGLang's fused shared experts, never offloaded

    @classmethod
    def compute(cls, moe_layer_ids: list[int] | tuple[int, ...], local_experts: int, w13_shard_bytes: int,
                w2_shard_bytes: int, granularity_bytes: int, max_offload_ratio: float,
                staging_capacity_shards: int, fused_shared_experts: int = 0) -> ExpertLayout:
        ids = tuple(int(i) for i in moe_layer_ids)
        _check(len(ids) > 0, "moe_layer_ids", ids, "must name at least one MoE layer")
        _check(list(ids) == sorted(set(ids)), "moe_layer_ids", ids, "must be strictly increasing")
        for name, value in (("local_experts", local_experts), ("w13_shard_bytes", w13_shard_bytes),
                            ("w2_shard_bytes", w2_shard_bytes), ("granularity_bytes", granularity_bytes)):
            _check(isinstance(value, int) and value > 0, name, value, "must be a positive integer")
        _check(0.0 <= max_offload_ratio < 1.0, "max_offload_ratio", max_offload_ratio, "must be in [0, 1)")
        _check(isinstance(staging_capacity_shards, int) and staging_capacity_shards >= 0,
               "staging_capacity_shards", staging_capacity_shards, "must be a non-negative integer")
        _check(isinstance(fused_shared_experts, int) and 0 <= fused_shared_experts < local_experts,
               "fused_shared_experts", fused_shared_experts, f"must be an integer in [0, {local_experts})")
        g = group_experts_for(w13_shard_bytes, w2_shard_bytes, granularity_bytes)
        routed = local_experts - fused_shared_experts
        groups = routed // g
        # Paper IV-C offloading bound: the staging slot's capacity, tightened by VAMP-r of the routed
        # experts; never all groups (floor(r*R/g) < R/g because r < 1). No eligible layer (a single MoE
        # layer) means no offload.
        by_ratio = math.floor(max_offload_ratio * routed / g + 1e-9)
        bound = min(staging_capacity_shards // g, by_ratio, groups) if len(ids) > 1 else 0
        return cls(ids, local_experts, w13_shard_bytes, w2_shard_bytes, granularity_bytes,
                   float(max_offload_ratio), staging_capacity_shards, g, groups, bound, fused_shared_experts)

    # ---- layers ------------------------------------------------------------------------------------

    @property
    def eligible_layer_ids(self) -> tuple[int, ...]:
        """Every MoE layer but the first, in forward order (paper V-B)."""
        return self.moe_layer_ids[1:]

    def eligible_index(self, layer_id: int) -> int | None:
        """Position of `layer_id` among the eligible layers (its staging slot is this index mod 2)."""
        try:
            return self.eligible_layer_ids.index(layer_id)
        except ValueError:
            return None

    # ---- one group ---------------------------------------------------------------------------------

    @property
    def w13_group_pages(self) -> int:
        return self.group_experts * self.w13_shard_bytes // self.granularity_bytes

    @property
    def w2_group_pages(self) -> int:
        return self.group_experts * self.w2_shard_bytes // self.granularity_bytes

    @property
    def pages_per_group_per_layer(self) -> int:
        return self.w13_group_pages + self.w2_group_pages

    @property
    def pages_freed_per_group(self) -> int:
        """Pages one step of the boundary frees: one group in every eligible layer (uniform boundary)."""
        return self.pages_per_group_per_layer * len(self.eligible_layer_ids)

    @property
    def bytes_freed_per_group(self) -> int:
        return self.pages_freed_per_group * self.granularity_bytes

    @property
    def routed_experts(self) -> int:
        """R: the local experts below the fused shared ones; the offloadable groups end here."""
        return self.local_experts - self.fused_shared_experts

    @property
    def always_resident_experts(self) -> int:
        """Experts no group holds, never offloaded: the low-index R mod g and the fused shared experts."""
        return self.local_experts - self.groups_per_layer * self.group_experts

    # ---- the residency boundary --------------------------------------------------------------------

    def check_offloaded_groups(self, offloaded_groups: int) -> None:
        _check(isinstance(offloaded_groups, int) and 0 <= offloaded_groups <= self.bound_groups,
               "offloaded_groups", offloaded_groups, f"must be an integer in [0, {self.bound_groups}]")

    def boundary_expert(self, offloaded_groups: int) -> int:
        """First offloaded expert index: experts [0, b) and [R, E) resident, [b, R) offloaded."""
        self.check_offloaded_groups(offloaded_groups)
        return self.routed_experts - offloaded_groups * self.group_experts

    def offload_ratio(self, offloaded_groups: int) -> float:
        """Fraction of each eligible layer's routed experts offloaded."""
        self.check_offloaded_groups(offloaded_groups)
        return offloaded_groups * self.group_experts / self.routed_experts

    def groups_for_ratio(self, ratio: float) -> int:
        """Most groups whose offloaded fraction stays <= `ratio`, capped at the bound."""
        _check(0.0 <= ratio <= 1.0, "ratio", ratio, "must be in [0, 1]")
        return min(self.bound_groups, math.floor(ratio * self.routed_experts / self.group_experts + 1e-9))

    @property
    def offloadable_experts(self) -> int:
        """Experts per eligible layer that may ever leave: the size of the host copy and of a staging slot."""
        return self.bound_groups * self.group_experts

    def kv_tokens_per_group(self, kv_bytes_per_token: int) -> int:
        """KV tokens one group's freed bytes hold, ignoring how pages split over the KV buffers
        (the per-buffer exact count is `kv_rows_for_bytes` applied by the KV buffers)."""
        _check(isinstance(kv_bytes_per_token, int) and kv_bytes_per_token > 0, "kv_bytes_per_token",
               kv_bytes_per_token, "must be a positive integer")
        return self.bytes_freed_per_group // kv_bytes_per_token


def group_experts_for(w13_shard_bytes: int, w2_shard_bytes: int, granularity_bytes: int) -> int:
    """g: the fewest consecutive shards whose w13 AND w2 bytes are both whole pages (paper V-A)."""
    need_w13 = granularity_bytes // math.gcd(granularity_bytes, w13_shard_bytes)
    need_w2 = granularity_bytes // math.gcd(granularity_bytes, w2_shard_bytes)
    return math.lcm(need_w13, need_w2)


def kv_pages_per_buffer(offloaded_groups: int, pages_freed_per_group: int, n_buffers: int) -> int:
    """Extra pages each KV buffer holds with `offloaded_groups` offloaded. Every buffer gets the same
    count, so every layer's K and V keep one token capacity; the remainder pages are held spare."""
    return offloaded_groups * pages_freed_per_group // n_buffers


def kv_rows_for_bytes(mapped_bytes: int, row_bytes: int, row_multiple: int = 1) -> int:
    """Token rows a buffer of `mapped_bytes` holds: whole rows only (a page need not hold whole rows),
    rounded down to `row_multiple` (the KV allocator's page size in tokens)."""
    rows = mapped_bytes // row_bytes
    return rows - rows % row_multiple



def pages_for_rows(rows: int, row_bytes: int, granularity_bytes: int, row_multiple: int) -> int:
    """Fewest pages per buffer whose capacity (whole rows, rounded to row_multiple) reaches `rows`."""
    pages = -(-rows * row_bytes // granularity_bytes)
    while kv_rows_for_bytes(pages * granularity_bytes, row_bytes, row_multiple) < rows:
        pages += 1
    return pages


def _check(ok: bool, field: str, value: object, message: str) -> None:
    if not ok:
        raise LayoutError(f"{field} {message} (got {value!r})")
