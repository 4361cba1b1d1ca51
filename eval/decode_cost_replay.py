"""Replay of routing traces through VAMP's residency and staging arithmetic (issue 49).

The residency comes from VAMP's own layout code: `ExpertLayout` (memory/layout.py) on the capacity
planner's per-rank geometry (memory/geometry.py) gives the groups VAMP-r offloads from each eligible layer
and the boundary b: physical experts [b, R) are offloaded. A step's routed offloaded rows are what
`routed_offloaded_runs` (memory/routed.py) copies; the replay counts them vectorised over layers and checks
the count against that function on its first steps (`check_steps`).

Residency by routing (`routed+order`; the server's `--vamp-expert-order routing`, memory/residency.py,
reorders only inside its offload and restore transactions, with a plain "hotter than" swap rule). Here each
eligible layer counts the
top-k ids it routes (exponentially decayed, half-life `halflife_steps`), and every `reorder_steps` steps (a
stand-in for the offload/restore transactions at which the server would change the order) a logical ->
physical permutation puts the coldest experts at [b, R) and the others below b, each side in id order; the
replay then runs the same index-based code on the permuted ids. A hot offloaded expert trades places with a
cold resident one only where the rows it would save before the next reorder (`reorder_steps` x the difference
of their per-step routing probabilities, from the decayed counts) exceed the one row the move copies, and
its count beats the cold one's by more than two Poisson standard deviations, so near-uniform routing does
not churn on sampling noise. Experts that move from the offloaded side to
the resident side are copied to the device (counted as staged bytes of that step); host copies of every
expert of an eligible layer are assumed (the server keeps only the offloadable ones).

A cache of staged experts across steps, within the staging memory VAMP reserves: the two staging slots
(memory/staging_slots.py) hold b..R rows each and are aliased into the expert tensors, eligible layer i
using slot i % 2, row e - b for expert e. A row still holds what the last layer of that parity staged into
it, so a routed step need not copy a row whose last writer was this very layer (`routed+cache`, what fits
the aliasing with no new memory). The bound of any policy on the same memory, a fully associative LRU over
(layer, expert) of 2 (R - b) rows, is reported next to it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from eval.decode_cost_traces import Trace
from vamp_sglang.memory.geometry import ModelGeometry
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.routed import routed_offloaded_runs

PAGE_BYTES = 2 << 20  # CUDA VMM granularity (paper V-A)
SIGNIFICANCE = 2.0  # standard deviations by which a hot expert's count must beat a cold one's to swap them


@dataclass(frozen=True)
class Residency:
    """One rank's offloaded range for a model at VAMP-r and how the trace's layers map onto it."""

    geometry: ModelGeometry
    layout: ExpertLayout
    boundary: int  # first offloaded physical expert
    routed_experts: int  # R
    row_bytes: int  # one expert's w13 + w2 shard on this rank
    trace_first_eligible: int  # index of the trace's first eligible layer (1 when it logs the first MoE layer)
    layer_scale: float  # eligible layers of the model / eligible layers the trace logs

    @property
    def offloaded(self) -> int:
        return self.routed_experts - self.boundary

    @property
    def eligible_layers(self) -> int:
        return len(self.layout.eligible_layer_ids)

    @property
    def whole_bytes_per_step(self) -> int:
        """Paper IV-D: every eligible layer's whole offloaded region, every step."""
        return self.eligible_layers * self.offloaded * self.row_bytes


def residency(geo: ModelGeometry, ratio: float, trace: Trace) -> Residency:
    lay = ExpertLayout.compute(geo.moe_layer_ids, geo.local_experts, geo.w13_shard_bytes, geo.w2_shard_bytes,
                               PAGE_BYTES, ratio, staging_capacity_shards=geo.local_experts)
    boundary = lay.boundary_expert(lay.bound_groups)
    first = 1 if trace.logs_first_layer else 0
    logged = trace.layers - first
    if logged <= 0:
        raise ValueError(f"trace {trace.name} logs no eligible MoE layer")
    return Residency(geo, lay, boundary, lay.routed_experts, geo.w13_shard_bytes + geo.w2_shard_bytes, first,
                     len(lay.eligible_layer_ids) / logged)


@dataclass
class LayerStep:
    """One step's per-layer counts (eligible logged layers), all under one residency order."""

    tokens: int
    rows: np.ndarray  # [L] distinct routed offloaded experts
    pairs: np.ndarray  # [L] (token, expert) pairs on offloaded experts
    cold_tokens: list[np.ndarray]  # per layer: tokens per routed offloaded expert
    resident_rows: np.ndarray  # [L] distinct routed resident experts
    routed_rows: list[np.ndarray]  # per layer: the offloaded physical ids routed


def count_step(ids: np.ndarray, perm: np.ndarray | None, res: Residency) -> LayerStep:
    """ids [L, T, k] logical ids of the eligible logged layers (-1 ignored); perm [L, E] or None (identity)."""
    layers, experts = ids.shape[0], res.geometry.local_experts
    valid = ids >= 0
    tokens = int(valid.any(axis=(0, 2)).sum()) if ids.size else 0
    safe = np.where(valid, ids, 0)
    phys = np.take_along_axis(perm, safe.reshape(layers, -1), axis=1).reshape(ids.shape) if perm is not None \
        else safe
    flat = (np.arange(layers)[:, None, None] * experts + phys)[valid]
    counts = np.bincount(flat, minlength=layers * experts).reshape(layers, experts)
    cold = counts[:, res.boundary:res.routed_experts]
    cold_tokens = [c[c > 0] for c in cold]
    routed_rows = [np.flatnonzero(c) + res.boundary for c in cold]
    return LayerStep(tokens, (cold > 0).sum(axis=1), cold.sum(axis=1), cold_tokens,
                     (counts[:, :res.boundary] > 0).sum(axis=1) + (counts[:, res.routed_experts:] > 0).sum(axis=1),
                     routed_rows)


def check_with_routed_py(ids: np.ndarray, perm: np.ndarray | None, res: Residency, step: LayerStep) -> None:
    """The vectorised count equals the rows `routed_offloaded_runs` (the server's host path) copies."""
    for layer in range(ids.shape[0]):
        layer_ids = ids[layer]
        if perm is not None:
            layer_ids = np.where(layer_ids >= 0, perm[layer][np.maximum(layer_ids, 0)], -1)
        runs = routed_offloaded_runs(torch.from_numpy(layer_ids), res.boundary, res.routed_experts)
        copied = sum(end - first for first, end in runs)
        if copied != int(step.rows[layer]):
            raise AssertionError(f"layer {layer}: replay counts {int(step.rows[layer])} rows, routed.py {copied}")


class RoutingOrder:
    """Decayed routing counts per eligible layer and the permutation that offloads the coldest experts."""

    def __init__(self, layers: int, res: Residency, halflife_steps: float, reorder_steps: int) -> None:
        self.res, self.reorder_steps = res, reorder_steps
        self.decay = 0.5 ** (1.0 / halflife_steps)
        experts = res.geometry.local_experts
        self.counts = np.zeros((layers, experts))
        self.perm = np.tile(np.arange(experts), (layers, 1))  # index order until the first reorder
        self.steps = 0

    def observe(self, ids: np.ndarray) -> int:
        """Count a step's logical ids; at a reorder, return the bytes of experts that become resident."""
        layers, experts = self.counts.shape
        self.counts *= self.decay
        valid = ids >= 0
        flat = (np.arange(layers)[:, None, None] * experts + np.where(valid, ids, 0))[valid]
        self.counts += np.bincount(flat, minlength=layers * experts).reshape(layers, experts)
        self.steps += 1
        if self.steps % self.reorder_steps:
            return 0
        res, moved = self.res, 0
        window = (1.0 - self.decay ** self.steps) / (1.0 - self.decay)  # decayed steps counted so far
        for layer in range(layers):
            # per-step probability that some token routes the expert (Poisson in its decayed pair rate)
            prob = 1.0 - np.exp(-self.counts[layer, :res.routed_experts] / window)
            physical = self.perm[layer, :res.routed_experts]
            off, on = np.flatnonzero(physical >= res.boundary), np.flatnonzero(physical < res.boundary)
            back = off[np.argsort(-prob[off], kind="stable")]  # the hottest offloaded experts first
            out = on[np.argsort(prob[on], kind="stable")]  # the coldest resident experts first
            swaps = 0
            counts = self.counts[layer]
            for hot, cold in zip(back, out, strict=False):  # a swap must save more rows than the one it copies
                gain = self.reorder_steps * (prob[hot] - prob[cold])
                noise = SIGNIFICANCE * np.sqrt(counts[hot] + counts[cold])  # Poisson: is hot really hotter?
                if gain <= 1.0 or counts[hot] - counts[cold] <= noise:
                    break
                swaps += 1
            if not swaps:
                continue
            moved += swaps
            cold = np.sort(np.concatenate([np.setdiff1d(off, back[:swaps]), out[:swaps]]))
            hot = np.setdiff1d(np.arange(res.routed_experts), cold)
            self.perm[layer, hot] = np.arange(len(hot))
            self.perm[layer, cold] = res.boundary + np.arange(len(cold))
        return moved * res.row_bytes


class SlotCache:
    """Rows still valid in the two aliased staging slots, and the LRU bound on the same memory."""

    def __init__(self, res: Residency, eligible_index: list[int]) -> None:
        self.res, self.eligible_index = res, eligible_index
        self.tags = np.full((2, res.offloaded), -1, dtype=np.int64)
        self.lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.capacity = 2 * res.offloaded
        self.slot_hits = self.lru_hits = self.needed = 0

    def step(self, routed_rows: list[np.ndarray]) -> int:
        """Rows this step must still copy with the slot cache (the LRU bound is only counted)."""
        copied = 0
        for layer, rows in enumerate(routed_rows):
            idx = self.eligible_index[layer]
            slot, pos = idx % 2, rows - self.res.boundary
            hit = self.tags[slot, pos] == idx
            self.slot_hits += int(hit.sum())
            copied += int((~hit).sum())
            self.tags[slot, pos] = idx
            self.needed += len(rows)
            for expert in rows.tolist():
                key = (idx, expert)
                if key in self.lru:
                    self.lru_hits += 1
                    self.lru.move_to_end(key)
                else:
                    self.lru[key] = None
                    if len(self.lru) > self.capacity:
                        self.lru.popitem(last=False)
        return copied
