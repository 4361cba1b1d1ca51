"""Cold experts computed where their weights already are: `--vamp-staging host` (issue 49).

Staging copies every routed offloaded expert's weights to the device each step, megabytes per expert,
for a decode step's few tokens per expert. The host already holds every offloaded expert (the host copy
made at start), so here the token-expert pairs routed to offloaded rows are computed from that copy
(plain torch, SiLU-gated w13 then w2, as SGLang's `moe_forward_native`) and only activations and results
cross the link (the decode-cost bench's `host` mode, eval/decode_cost_model.py). The layer's own kernel
runs the same dispatch with those slots masked as -1, the id SGLang's dispatcher gives another rank's
expert under EP, which CPU mode's native MoE skips (cpu/parallel.py: one call per slot, a -1 slot adds
nothing; a row may not name one expert twice, so row 0 with weight 0 would not do), and weight 0; the
layer's output is the kernel's plus the host half. Under tensor parallelism each rank's host copy holds its shard of
every offloaded expert, so its host half is the same partial sum its kernel would have made, and the
all-reduce after the MoE adds the ranks' halves as it adds their kernels'.

Here the CPU path: the split reads on the host which slots are cold, which on a GPU would be a sync
inside the graph; there the same split and `cold_output` run around the kernel in two eager graph breaks,
the activations crossing through pinned buffers (host_experts_cuda.py). On CPUs with Intel AMX SGLang runs
its fused CPU kernel instead of the native MoE, which was not checked with -1 ids. Unquantised SiLU
experts without a routed scaling factor only (`host_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vamp_sglang.memory.experts import ExpertStore
from vamp_sglang.memory.routed import host_offset


@dataclass
class HostExpertStats:
    """`/vamp/stats` `host_experts`: token-expert pairs computed on the host, over forward steps."""

    pairs: int = 0
    steps: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"pairs": self.pairs, "steps": self.steps,
                "pairs_per_step": round(self.pairs / self.steps, 3) if self.steps else 0.0}


def host_refusal(layer: Any) -> str | None:
    """Why this FusedMoE layer's cold experts cannot be computed here, or None."""
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    config = getattr(layer, "moe_runner_config", None)
    if not isinstance(layer.quant_method, UnquantizedFusedMoEMethod):
        return f"quant method {type(layer.quant_method).__name__}"
    if config is None or getattr(config, "activation", "silu") != "silu" or getattr(config, "gemm1_alpha", None):
        return "an activation other than SiLU"
    if getattr(config, "routed_scaling_factor", None) not in (None, 1.0):
        return "a routed scaling factor"
    if getattr(config, "apply_router_weight_on_input", False):
        return "router weights applied on the input"
    return None


def cold_output(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, cold: torch.Tensor,
                store: ExpertStore, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The cold slots' weighted expert outputs [tokens, hidden] from the host copy, and their count;
    written into `out` when given (the GPU path's pinned buffer, reused every step)."""
    offset = host_offset(store)
    out = torch.zeros_like(x) if out is None else out.zero_()
    tokens, slots = cold.nonzero(as_tuple=True)
    picked = ids[tokens, slots]
    host = store.host_w13.device
    for expert in picked.unique().tolist():
        chosen = picked == expert
        tok, slot = tokens[chosen], slots[chosen]
        rows = x[tok].to(host)
        gate, up = (rows @ store.host_w13[expert - offset].T).chunk(2, dim=-1)
        part = (F.silu(gate) * up) @ store.host_w2[expert - offset].T
        out.index_add_(0, tok, part.to(x.device) * weights[tok, slot, None].to(x.dtype))
    return out, len(tokens)


def run_moe_core_host(original: Any, layer: Any, store: ExpertStore, stats: HostExpertStats,
                      first_layer: bool, dispatch_output: Any) -> Any:
    """`run_moe_core` with the slots routed to offloaded rows masked, plus their host half."""
    stats.steps += first_layer
    topk = dispatch_output.topk_output
    ids, weights = topk.topk_ids, topk.topk_weights
    cold = (ids >= store.boundary_expert) & (ids < store.routed_experts)
    if not store.offloaded_groups or not bool(cold.any()):
        return original(layer, dispatch_output=dispatch_output)
    host, pairs = cold_output(dispatch_output.hidden_states, ids, weights, cold, store)  # before an in-place kernel
    stats.pairs += pairs
    masked = topk._replace(topk_ids=torch.where(cold, torch.full_like(ids, -1), ids),
                           topk_weights=torch.where(cold, torch.zeros_like(weights), weights))
    out = original(layer, dispatch_output=dispatch_output._replace(topk_output=masked))
    out.hidden_states.add_(host)
    return out
