"""Every FusedMoE layer's experts rebuilt over reserved virtual ranges, and staging around its MoE kernel.

Paper IV-C: an eligible layer's high-index expert groups can leave only if its `w13_weight` / `w2_weight`
live on pages that can be unmapped; `convert_experts` rebuilds them over the memory layer's
`ExpertStore` (first MoE layer resident, host copies of the offloadable groups made once) right after
SGLang loaded the model, before the KV pool is sized and graphs are captured, so both see the final
addresses. Layers are converted one at a time and each original tensor is dropped at once, so peak
memory grows by one layer, not by the model.

Paper V-B: offloaded experts are read from a staging slot aliased into the tensor's offloaded range.
`run_moe_core_staged` brackets the layer's MoE kernel with the staging engine's `before_moe` (wait for
this layer's copy, start the next eligible layer's copy into the other slot) and `after_moe` (the slot
may be refilled once the kernel is done); `begin_forward` starts the first copy at forward start.

CUDA graphs stay on while experts are offloaded (issue 10). `before_moe` runs as SGLang's
`eager_on_graph` break, so under the breakable graph backend (decode: set by our launcher; prefill:
SGLang's CUDA default) each eligible MoE layer's kernels are captured in a segment while the break
between segments runs eagerly at every replay: it reads the live boundary, waits on this layer's copy
and issues the next one. The MoE kernel reads fixed addresses (the slot aliases), so a remap needs no
re-capture. `after_moe` is not replayed (it did nothing while capturing); the next break then orders the
slot's reuse after everything enqueued so far (staging.py). Outside a breakable capture the break is a
plain call. We chose this over SGLang's device-side `paged_experts_gather` in a full graph: the gather
is an SM kernel (a fixed 256x256 grid sized for a few experts) that would compete with the MoE GEMMs
for SMs, while our copies run on the copy engines from pinned memory, the path the paper measures; the
gather also needs a JIT-built kernel and a fork/join of streams inside the capture. The cost of ours is
one graph segment boundary and one Python call per eligible layer and step.

A break must run on the capture stream (issue 19 item 1): `eager_on_graph` ends the segment and begins
the next on the current stream. Qwen2-MoE, Qwen3-Next and GLM-4-MoE run their router and experts on
the block's `alt_stream` while capturing, so `convert_experts` takes that stream from the blocks of the
eligible layers (they then take SGLang's single-stream path, as its own paged experts do), and a break
reached on any other stream during a capture raises `SideStreamBreakError` naming the layer.

Routed-only staging (issue 12): the break also passes the router's top-k ids (the `topk_output` that
reaches `run_moe_core`), so a routed step copies only the selected offloaded experts right there; on
CUDA through SGLang's gather with a device-built copy list (routed_gather.py), which needs no host sync
and so keeps the graph segments and replays as they are. The break's tensor argument is the capture-time
top-k buffer, which every replay refills in place.

Residency by routing (issue 49, `--vamp-expert-order routing`, memory/residency.py): the same place, before
the break, counts the router's logical ids and rewrites them in place as the physical rows that hold those
experts (fixed-shape device ops on fixed tensors, so captured segments replay the live order), so the
staging break and the kernel read physical rows; the Repartitioner swaps rows, host copies and per-expert
tensors inside each offload or restore, so the offloaded rows hold the least-routed experts (which
layers may be reordered, over which ranks counts are summed, and which rows count: expert_order.py).

Host experts (issue 49, `--vamp-staging host`): no staging; the slots routed to offloaded rows are masked
for the kernel and computed from the host copies, on the CPU before the kernel (host_experts.py), on CUDA
in two breaks around it, the kernel overlapping the CPU's matmuls (host_experts_cuda.py).

Paper V-B: the gate-up GEMM needs only w13, so where SGLang runs the two GEMMs as separate launches
(its Triton MoE: two `invoke_fused_moe_kernel` calls in `_fused_moe_kernel_sequence`) the layer waits
for w13 at `before_moe` and for w2 right before the down GEMM (`invoke_fused_moe_kernel_staged`, a
second break), so the gate-up GEMM runs while w2 is still copying. Every other MoE kernel (CPU,
FlashInfer, DeepGEMM, triton_kernels, aiter) runs both GEMMs in one call and waits for both first.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vamp_sglang.integration.staging.expert_order import per_expert_tensors, routing_group, routing_refusal
from vamp_sglang.integration.staging.host_experts import HostExpertStats, host_refusal, run_moe_core_host
from vamp_sglang.integration.staging.host_experts_cuda import (
    CudaCopies,
    HostRoundTrip,
    host_threads,
    run_moe_core_host_cuda,
    sglang_binds_ranks,
)
from vamp_sglang.integration.staging.step_modes import host_step, moe_sees_local_tokens
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.experts import ExpertStore
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.residency import ExpertRows, Residency
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import StagingBuffers, close_expert_stores


class ExpertConversionError(RuntimeError):
    """The model's MoE layers cannot be rebuilt over paged memory; the message names the layer."""


class SideStreamBreakError(RuntimeError):
    """A staging break was reached on a stream other than the one the graph captures on."""


@dataclass(eq=False)
class ModelExperts:
    """One model's paged experts: the layout, one store per eligible layer, the staging engine."""

    backend: PageBackend
    layout: ExpertLayout
    staging_buffers: StagingBuffers
    stores: list[ExpertStore]
    engine: StagingEngine
    layers: dict[int, Any] = field(default_factory=dict)  # eligible layer_id -> its FusedMoE module
    w2_owners: dict[int, int] = field(default_factory=dict)  # store.w2.data_ptr() -> its layer_id
    residency: Residency | None = None  # --vamp-expert-order routing: which experts an offload takes
    host: HostExpertStats | None = None  # --vamp-staging host: cold experts computed from the host copies
    host_trip: HostRoundTrip | None = None  # ... on CUDA: their round trip around the kernel, two breaks

    @property
    def offloaded_groups(self) -> int:
        return self.stores[0].offloaded_groups if self.stores else 0

    def close(self) -> None:
        self.engine.close()
        close_expert_stores(self.staging_buffers, self.stores)


def find_moe_layers(model: torch.nn.Module) -> list[Any]:
    """The model's FusedMoE modules in forward (layer_id) order."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    layers = sorted((m for m in model.modules() if isinstance(m, FusedMoE)), key=lambda m: m.layer_id)
    ids = [m.layer_id for m in layers]
    if len(set(ids)) != len(ids):
        raise ExpertConversionError(f"FusedMoE layer ids {ids} are not unique")
    return layers


def expert_device(model: torch.nn.Module) -> torch.device:
    """Where the experts live (the page backend must serve this device)."""
    layers = find_moe_layers(model)
    if not layers:
        raise ExpertConversionError("the model has no FusedMoE layer; VAMP needs an MoE model")
    return layers[0].w13_weight.device


def unpageable_method(layer: Any) -> str | None:
    """Why VAMP cannot page this layer's quant method, or None. Paged: unquantised experts, and
    block-quantised FP8 (`Fp8MoEMethod` with `weight_block_size`, e4m3 weights [E, ...]). An FP8
    expert's weights are paged like any others (1 byte per element); its `weight_scale_inv` tensors,
    4 bytes per 128x128 block (1/4096 of the weights, less than one page for a whole layer), stay
    resident, so an offloaded expert's scales are always where the kernel reads them and nothing
    else about the method changes. Any other method (per-tensor FP8, MXFP8/MXFP4, INT4, W4A8, ...)
    may lay its experts out in ways the pages do not follow, and is refused."""
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    method = layer.quant_method
    name = type(method).__name__
    if isinstance(method, UnquantizedFusedMoEMethod):
        return None
    if not isinstance(method, Fp8MoEMethod):
        return f"quant method {name}"
    if not method.block_quant:
        return f"{name} with per-tensor scales"
    if getattr(method, "use_mxfp8", False) or getattr(method, "is_fp4_expert", False):
        return f"{name} with {'MXFP8' if getattr(method, 'use_mxfp8', False) else 'FP4'} experts"
    if layer.w13_weight.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return f"{name} with {layer.w13_weight.dtype} weights"
    return None


def _check_layer(layer: Any, reference: Any, device: torch.device) -> None:
    where = f"MoE layer {layer.layer_id}"
    if (reason := unpageable_method(layer)) is not None:
        raise ExpertConversionError(f"{where}: {reason} is not supported (VAMP pages unquantised and "
                                    f"block-quantised FP8 experts; see README, Supported checkpoints)")
    for name in ("w13_weight", "w2_weight"):
        t, ref = getattr(layer, name), getattr(reference, name)
        if t.dim() != 3 or t.shape != ref.shape or t.dtype != ref.dtype or not t.is_contiguous():
            raise ExpertConversionError(f"{where}: {name} {tuple(t.shape)} {t.dtype} differs from layer "
                                        f"{reference.layer_id}'s {tuple(ref.shape)} {ref.dtype} or is strided")
        if t.device.type != device.type:
            raise ExpertConversionError(f"{where}: {name} is on {t.device}, the page backend serves {device}")
    if fused_shared_experts(layer) != fused_shared_experts(reference):
        raise ExpertConversionError(f"{where}: {fused_shared_experts(layer)} fused shared experts, layer "
                                    f"{reference.layer_id} has {fused_shared_experts(reference)}")


def fused_shared_experts(layer: Any) -> int:
    """The shared experts SGLang fused into this FusedMoE: its last local rows, after the routed ones
    (fused_moe_triton/layer.py:416, weight loader :1212-1225), selected by every token; never offloaded."""
    return int(getattr(layer, "num_fused_shared_experts", 0) or 0)


def splits_w2_wait(layers: list[Any], device: torch.device) -> bool:
    """Whether every layer runs SGLang's Triton MoE (`UnquantizedFusedMoEMethod.forward_cuda`'s last
    branch), the one kernel path whose down GEMM is a separate `invoke_fused_moe_kernel` call that our
    hook sees; any other path would read w2 unwaited if only w13 were awaited."""
    if device.type != "cuda" or not layers:
        return False
    for layer in layers:
        method = layer.quant_method
        runner = getattr(method, "runner", None)
        if (runner is None or not runner.runner_backend.is_triton() or getattr(method, "_aiter_runner", None)
                or getattr(method, "use_flashinfer_cutlass", False)
                or getattr(method, "use_flashinfer_trtllm_moe", False)):
            return False
    return True


def compute_layout(layers: list[Any], granularity_bytes: int, max_offload_ratio: float) -> ExpertLayout:
    """The expert layout of these layers on this rank (paper IV-C, V-A)."""
    w13, w2 = layers[0].w13_weight, layers[0].w2_weight
    return ExpertLayout.compute(
        moe_layer_ids=[m.layer_id for m in layers], local_experts=int(w13.shape[0]),
        w13_shard_bytes=w13[0].numel() * w13.element_size(), w2_shard_bytes=w2[0].numel() * w2.element_size(),
        granularity_bytes=granularity_bytes, max_offload_ratio=max_offload_ratio,
        staging_capacity_shards=int(w13.shape[0]),  # the ratio bounds staging (both slots are allocated)
        fused_shared_experts=fused_shared_experts(layers[0]))


def convert_experts(model: torch.nn.Module, backend: PageBackend, max_offload_ratio: float,
                    staging_mode: str = "async", staging_policy: str = "whole",
                    expert_order: str = "index") -> ModelExperts:
    """Rebuild every eligible layer's w13/w2 over an ExpertStore, in place (`param.data` swap)."""
    layers = find_moe_layers(model)
    if not layers:
        raise ExpertConversionError("the model has no FusedMoE layer; VAMP needs an MoE model")
    for layer in layers:
        _check_layer(layer, layers[0], backend.device)
        if expert_order == "routing" and (reason := routing_refusal(layer)) is not None:
            raise ExpertConversionError(f"--vamp-expert-order routing: MoE layer {layer.layer_id} {reason}; "
                                        f"use --vamp-expert-order index")
    layout = compute_layout(layers, backend.granularity_bytes, max_offload_ratio)
    staging = StagingBuffers(backend, layout)  # also the one host arena for every layer's host copy
    stores: list[ExpertStore] = []
    eligible = [m for m in layers if layout.eligible_index(m.layer_id) is not None]
    for layer in eligible:
        alias_w13, alias_w2 = staging.alias_pages(layer.layer_id)
        store = ExpertStore(backend, layout, layer.layer_id, layer.w13_weight.data, layer.w2_weight.data,
                            alias_w13, alias_w2, host_arena=staging.host_arena)
        stores.append(store)
        layer.replace_expert_tensor("w13_weight", store.w13)  # the original storage is freed here
        layer.replace_expert_tensor("w2_weight", store.w2)
        if backend.device.type == "cuda":
            torch.cuda.empty_cache()  # let the driver's pages reuse what torch just freed
    if layout.bound_groups:  # the eligible layers get staging breaks
        keep_moe_on_capture_stream(model, eligible)
    host_capable = staging_policy == "host" or (staging_policy == "auto" and backend.device.type == "cpu"
                                                and bool(stores) and all(host_refusal(m) is None for m in eligible))
    host = HostExpertStats() if host_capable else None  # auto picks host steps only where they can run (CPU)
    for layer in eligible if host is not None else ():
        if (reason := host_refusal(layer)) is not None:
            raise ExpertConversionError(f"MoE layer {layer.layer_id}: --vamp-staging host cannot compute {reason}")
        if backend.device.type == "cuda" and not splits_w2_wait([layer], backend.device):  # -1 ids skipped
            raise ExpertConversionError(f"MoE layer {layer.layer_id}: --vamp-staging host on a GPU needs SGLang's "
                                        f"Triton MoE runner, which skips the -1 ids of the host's slots")
    copier = None
    if backend.device.type == "cuda" and staging_policy != "whole" and stores:
        from vamp_sglang.integration.staging.routed_gather import GatherCopier

        copier = GatherCopier(stores)
    engine = StagingEngine(stores, mode=staging_mode,
                           split_w2_wait=host is None and splits_w2_wait(eligible, backend.device),
                           staging=staging_policy, top_k=int(layers[0].top_k) - layout.fused_shared_experts,
                           routed_copier=copier, ep_size=int(getattr(layers[0], "moe_ep_size", 1)),
                           host_capable=host_capable, trim_padding=moe_sees_local_tokens())
    trip = None
    if host is not None and stores and backend.device.type == "cuda":
        trip = HostRoundTrip(CudaCopies(backend.device), host, host_threads(sglang_binds_ranks()),
                             engine.real_tokens)
    residency = None
    if expert_order == "routing" and layout.bound_groups and stores:
        rows = [ExpertRows([s.w13, s.w2], [s.host_w13, s.host_w2], s.routed_experts,
                           per_expert_tensors(m, layout.local_experts)) for s, m in zip(stores, eligible)]
        residency = Residency(rows, backend.device, group=routing_group(eligible[0]))
    return ModelExperts(backend, layout, staging, stores, engine, {m.layer_id: m for m in eligible},
                        {s.w2.data_ptr(): s.layer_id for s in stores}, residency, host, trip)


def keep_moe_on_capture_stream(model: torch.nn.Module, layers: list[Any]) -> None:
    """Take the side stream from the MoE blocks that own `layers`, so that they run their experts, and
    so our breaks, on the capture stream. Qwen2-MoE's block (Qwen3-Next's too) forks the routed experts
    onto `self.alt_stream` whenever `get_is_capture_mode()` (models/qwen2_moe.py:833-848, 788), GLM-4-MoE's
    likewise (models/glm4_moe.py:573-579, 593); with no `alt_stream` both take their single-stream
    branch, which SGLang itself picks for its paged experts' breaks (qwen2_moe.py:838-842). The price is
    the shared expert's overlap with the routed experts in these layers' captured steps."""
    owned = {id(layer) for layer in layers}
    for module in model.modules():
        if getattr(module, "alt_stream", None) is not None and any(id(c) in owned for c in module.children()):
            module.alt_stream = None


# ---- the forward path ------------------------------------------------------------------------------

def run_moe_core_staged(experts: ModelExperts, original: Callable, layer: Any, *args: Any, **kwargs: Any) -> Any:
    """`FusedMoE.run_moe_core` after the staging break (`before_moe`) and before `after_moe`."""
    if experts.layers.get(layer.layer_id) is not layer or not staging_breaks(experts):
        return original(layer, *args, **kwargs)  # resident first layer, another model's layer, no bound
    check_capture_stream(layer.layer_id)
    topk_ids = None if keeps_global_expert_ids(layer) else routed_ids(*args, **kwargs)
    index = experts.layout.eligible_index(layer.layer_id)
    if experts.residency is not None:  # logical ids counted, then mapped to the rows that hold them
        experts.residency.route(index, topk_ids)
    if host_step(experts) and topk_ids is not None:  # no staging: the host half instead
        dispatch = kwargs.get("dispatch_output", args[0] if args else None)
        if experts.host_trip is not None:
            return run_moe_core_host_cuda(original, layer, experts.stores[index], experts.host_trip, index == 0,
                                          dispatch)
        pairs, start = experts.host.pairs, time.perf_counter()
        out = run_moe_core_host(original, layer, experts.stores[index], experts.host, index == 0, dispatch)
        experts.engine.host_layer(experts.host.pairs - pairs, time.perf_counter() - start)
        experts.engine.after_moe(layer.layer_id)  # the step's measured time, at the last eligible layer
        return out
    if topk_ids is None:  # seen at capture (before any served step) or at the first eager forward
        experts.engine.chooser.without_routed_ids(layer.layer_id)
    staging_break()(experts.engine, layer.layer_id, topk_ids)
    out = original(layer, *args, **kwargs)
    experts.engine.after_moe(layer.layer_id)
    return out


def invoke_fused_moe_kernel_staged(experts: ModelExperts, original: Callable, a: torch.Tensor, b: torch.Tensor,
                                   *args: Any, **kwargs: Any) -> Any:
    """SGLang's Triton `invoke_fused_moe_kernel(A, B, ...)`: when B is an eligible layer's w2 and the
    engine splits its waits, wait for that layer's w2 copy first (a break, like `before_moe`)."""
    layer_id = experts.w2_owners.get(b.data_ptr()) if experts.engine.split_w2_wait else None
    if layer_id is not None:
        check_capture_stream(layer_id)
        w2_break()(experts.engine, layer_id)
    return original(a, b, *args, **kwargs)


def check_capture_stream(layer_id: int) -> None:
    """Refuse a break reached on a side stream during a breakable capture: `eager_on_graph` would end
    the segment and begin the next one on that stream (breakable_cuda_graph.py:278, 315), and the
    capture would fail at its end as unjoined. The capture stream is the one
    `BreakableCUDAGraphCapture.__enter__` records with the capture (breakable_cuda_graph.py:391-394);
    outside a capture, or in a capture that records none, there is nothing to check."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
        _current_capture_var,
        _current_stream_var,
    )

    capturing = _current_stream_var.get()
    if _current_capture_var.get() is None or capturing is None:
        return
    current = torch.cuda.current_stream()
    if current != capturing:
        raise SideStreamBreakError(f"MoE layer {layer_id}'s staging break runs on {current} while the graph "
                                   f"captures on {capturing}: run this layer's experts on the capture stream")


@functools.cache
def w2_break() -> Callable[[StagingEngine, int], None]:
    """`engine.before_down_proj(layer_id)` as an `eager_on_graph` break (see `staging_break`)."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph

    @eager_on_graph
    def vamp_wait_w2(engine: StagingEngine, layer_id: int) -> None:
        engine.before_down_proj(layer_id)

    return vamp_wait_w2


def routed_ids(dispatch_output: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """The router's top-k ids `[tokens, k]` in `run_moe_core(dispatch_output)`, or None: SGLang's STANDARD
    top-k formats carry them; BYPASSED (FlashInfer TRT-LLM and MXFP4 route from the logits in their kernel),
    TRITON_KERNEL and PACKED do not (sglang/srt/layers/moe/topk.py:346-450). Such a layer stages its whole
    region, and the chooser then picks whole steps (`StagingChooser.without_routed_ids`)."""
    dispatch_output = kwargs.get("dispatch_output", dispatch_output)
    topk_ids = getattr(getattr(dispatch_output, "topk_output", None), "topk_ids", None)
    return topk_ids if isinstance(topk_ids, torch.Tensor) else None


def keeps_global_expert_ids(layer: Any) -> bool:
    """Under expert parallelism, runners that take global expert ids (FlashInfer CUTLASS/CuteDSL/TRT-LLM,
    hpc_ops, MXFP4: `_keeps_global_expert_ids`, token_dispatcher/standard.py:105-114) get a STANDARD top-k
    output whose ids were never mapped to this rank's rows (standard.py:225-227). Read as local rows they
    would stage another rank's experts and leave this rank's stale, so such a layer counts as one without
    ids: it stages its whole region."""
    dispatcher = getattr(layer, "dispatcher", None)
    return getattr(layer, "moe_ep_size", 1) > 1 and bool(getattr(dispatcher, "skip_local_expert_mapping", False))


@functools.cache
def staging_break() -> Callable[[StagingEngine, int, torch.Tensor | None], None]:
    """`engine.before_moe(layer_id, topk_ids)` as an `eager_on_graph` break: eager between the segments
    of a breakable CUDA graph (capture and every replay), a plain call everywhere else. Its arguments are
    an object, an int and the router's top-k tensor, so a replay passes the same engine, which reads its
    live state, and the capture-time top-k buffer, which holds this replay's ids (issue 12)."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph

    @eager_on_graph
    def vamp_stage_experts(engine: StagingEngine, layer_id: int, topk_ids: torch.Tensor | None) -> None:
        engine.before_moe(layer_id, topk_ids)

    return vamp_stage_experts


def staging_breaks(experts: ModelExperts | None) -> int:
    """Eager breaks one forward adds to a breakable CUDA graph: one per eligible layer that can offload,
    two with split w13/w2 waits or host experts on CUDA. Graphs are never refused because of offloading."""
    if experts is None or not experts.layout.bound_groups:
        return 0
    return len(experts.layers) * (2 if experts.engine.split_w2_wait or experts.host_trip is not None else 1)
