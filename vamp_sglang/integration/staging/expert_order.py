"""Residency by routing in SGLang's MoE layers (issue 49, `--vamp-expert-order routing`; the order itself:
memory/residency.py): which per-expert tensors move with a row, which layers cannot be reordered safely,
over which ranks the routing counts are summed, and which top-k rows they count.
"""

from __future__ import annotations

from typing import Any

import torch


def per_expert_tensors(layer: Any, experts: int) -> list[torch.Tensor]:
    """The layer's per-expert parameters besides w13/w2 (FP8 block scales, biases): resident rows that
    move with their expert when residency by routing swaps two rows."""
    return [p.data for name, p in layer.named_parameters(recurse=False)
            if name not in ("w13_weight", "w2_weight") and p.dim() >= 1 and p.shape[0] == experts]


def routing_refusal(layer: Any) -> str | None:
    """Why residency by routing cannot swap this layer's rows, or None. A swap moves w13/w2, their host
    copies and the layer's per-expert Parameters (`per_expert_tensors`), all SGLang's Triton MoE reads
    (the CPU path runs it too); other runners keep derived per-expert copies a swap would leave behind,
    e.g. hpc_ops FP8's padded scales as plain attributes (quantization/fp8.py _prepare_hpc_ops_weights)."""
    method = layer.quant_method
    runner = getattr(getattr(method, "runner", None), "runner_backend", None)
    if (runner is None or not runner.is_triton() or getattr(method, "_aiter_runner", None)
            or getattr(method, "use_flashinfer_cutlass", False)
            or getattr(method, "use_flashinfer_trtllm_moe", False)):
        return f"runs the {getattr(runner, 'value', runner)} MoE runner (routing order needs triton)"
    experts = layer.w13_weight.shape[0]
    plain = sorted(name for name, t in [*vars(layer).items(), *layer.named_buffers(recurse=False)]
                   if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == experts)
    return f"keeps per-expert tensors a swap would not move: {', '.join(plain)}" if plain else None


def routing_group(layer: Any) -> Any:
    """The CPU group over which routing counts are summed inside every offload and restore, so its ranks
    offload the same experts: ranks that run those transactions together, one round group
    (controller/groups.py). Plain TP: the TP group. DP attention: the rank's attention-TP group (None at
    attention-TP 1), never the TP group, where the other DP ranks, which remap in their own rounds, sit
    in SGLang's per-step MLP-sync all_gather (layers/dp_attention.py); its attention-CP peers are left
    out (no SGLang group spans both), so they may order their own slices apart. None under expert
    parallelism (each rank orders its own experts) or on one rank."""
    if getattr(layer, "moe_ep_size", 1) > 1:
        return None
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    group = parallel.attn_tp_group if parallel.attn_dp_enabled else parallel.tp_group
    return group.cpu_group if group.world_size > 1 else None


def count_real_rows(experts: Any) -> None:
    """At forward start, after `StagingEngine.begin_forward` (the hook before `ModelRunner._forward_raw`:
    eager, ahead of any replay): which top-k rows of `ModelExperts`'s step residency by routing counts. The
    count runs inside the captured segment, before the staging break, so it cannot slice by a host count as
    the breaks do; it masks the rows at or past a device scalar written here from the count routed staging
    trims to (`StagingEngine.real_tokens`: None, every row counted, where `moe_sees_local_tokens` finds
    that the MoE's rows are not this rank's own tokens, under DP attention or an all-to-all dispatcher)."""
    if experts.residency is not None:
        experts.residency.counts.set_real_tokens(experts.engine.real_tokens())
