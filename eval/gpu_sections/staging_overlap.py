"""gpu_check section `overlap`: a Qwen3-Next-sized layer (512 experts, hidden 2048, expert intermediate 512,
bf16, top-10), 4 MoE layers of which 3 stage 25% of their experts: the fraction of staging hidden behind
the MoE compute at decode batch 1, 16 and 64, from step times with and without offload and the engine's
own copy-event times; then the same steps with routed staging (the host run uses toy sizes; its figures mean
nothing for a GPU)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from eval.gpu_sections.routed_staging import UvaCopier
from eval.gpu_sections.toy_moe import moe_layer
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores


def check(backend: PageBackend, gpu: bool) -> dict:
    """Fraction of staging hidden behind MoE compute at decode batch 1, 16, 64 (Qwen3-Next-sized layer)."""
    dev, dtype = backend.device, (torch.bfloat16 if gpu else torch.float32)
    experts, hidden, inter, top_k = (512, 2048, 512, 10) if gpu else (16, 128, 64, 2)
    layer_ids, ratio, reps = [0, 1, 2, 3], 0.25, 10 if gpu else 2
    gen = torch.Generator(device=dev).manual_seed(2)
    first = (torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen, dtype=dtype) / 32,
             torch.randn(experts, hidden, inter, device=dev, generator=gen, dtype=dtype) / 16)
    shard = (first[0][0].numel() * first[0].element_size(), first[1][0].numel() * first[1].element_size())
    layout = ExpertLayout.compute(layer_ids, experts, *shard, backend.granularity_bytes, ratio, experts)
    staging, stores = build_expert_stores(backend, layout, {lid: first for lid in layout.eligible_layer_ids})
    tensors = {0: first} | {s.layer_id: (s.w13, s.w2) for s in stores}
    engine = StagingEngine(stores, "async")
    result = {"experts": experts, "hidden": hidden, "expert_intermediate": inter, "top_k": top_k,
              "layers": len(layer_ids), "staged_layers": len(stores), "offload_ratio": ratio, "batches": []}
    outputs_exact = True
    for batch in (1, 16, 64):
        used = max(1, round(experts * (1 - (1 - top_k / experts) ** batch)))  # expected routed experts
        per_expert = math.ceil(batch * top_k / used)
        x = torch.randn(used, per_expert, hidden, device=dev, generator=gen, dtype=dtype)

        def forward(x: torch.Tensor = x, used: int = used) -> torch.Tensor:
            engine.begin_forward()
            out = x
            for lid in layer_ids:
                engine.before_moe(lid)
                w13, w2 = tensors[lid]
                out = moe_layer(x, w13[experts - used:], w2[experts - used:])  # reads the offloaded tail
                engine.after_moe(lid)
            return out

        resident_ms, resident_out = _median_ms(forward, reps, backend)
        for store in stores:
            for handle in store.offload_tail_pages(layout.bound_groups):
                backend.release(handle)
        before = engine.stats()
        staged_ms, staged_out = _median_ms(forward, reps, backend)
        backend.synchronize()
        after = engine.stats()
        copies = after.copies - before.copies
        copy_ms = (after.copy_s - before.copy_s) / max(1, copies) * len(stores) * 1e3
        exposed_ms = max(0.0, staged_ms - resident_ms)
        outputs_exact &= torch.equal(staged_out, resident_out)
        result["batches"].append({
            "batch": batch, "routed_experts": used, "tokens_per_expert": per_expert,
            "resident_step_ms": round(resident_ms, 3), "staged_step_ms": round(staged_ms, 3),
            "copy_ms_per_step": round(copy_ms, 3),
            "wait_ms_per_step": round((after.wait_s - before.wait_s) / max(1, copies) * len(stores) * 1e3, 3),
            "stalls_per_step": round((after.stalls - before.stalls) / max(1, copies) * len(stores), 2),
            "copy_gb_per_s": round(stores[0].staged_bytes() * len(stores) / copy_ms / 1e6, 1) if copy_ms else None,
            "hidden_fraction": round(min(1.0, max(0.0, 1 - exposed_ms / copy_ms)), 3) if copy_ms else None})
        engine.drain()
        routed = _routed_step(stores, tensors, layer_ids, x, used, batch, top_k, reps, backend, gpu)
        outputs_exact &= torch.equal(routed.pop("output"), resident_out)
        result["batches"][-1].update(routed)
        for store in stores:
            store.restore_tail(None, layout.bound_groups)
    result["staged_bytes_per_layer"] = stores[0].layout.offloadable_experts * sum(shard)
    result["pinned_bytes"] = staging.pinned_bytes
    result["outputs_exact"] = outputs_exact
    result["ok"] = outputs_exact and all(b["hidden_fraction"] is not None for b in result["batches"])
    engine.close()
    close_expert_stores(staging, stores)
    return result


def _routed_step(stores, tensors, layer_ids, x, used, batch, top_k, reps, backend, gpu) -> dict:
    """The same staged step under `--vamp-staging routed`: each eligible layer copies only the offloaded
    experts its tokens route to, on the compute stream right before its MoE (all wait, nothing hidden),
    so it pays where few of the offloaded experts are routed (batch 1 here) and copies everything else
    whole staging does once the batch routes to them all. On a GPU the copier is the routed section's
    torch-only one (this script may not import SGLang's gather)."""
    experts = stores[0].routed_experts
    ids = (experts - used + torch.arange(batch * top_k, device=x.device) % used).view(batch, top_k)  # the tail read
    copier = UvaCopier(stores) if gpu else None
    engine = StagingEngine(stores, "async", staging="routed", top_k=top_k, routed_copier=copier)

    def forward() -> torch.Tensor:
        engine.begin_forward(batch)
        out = x
        for lid in layer_ids:
            engine.before_moe(lid, ids)
            w13, w2 = tensors[lid]
            out = moe_layer(x, w13[experts - used:], w2[experts - used:])
            engine.after_moe(lid)
        return out

    step_ms, out = _median_ms(forward, reps, backend)
    backend.synchronize()
    engine.drain()
    stats = engine.stats().by_mode["routed"]
    engine.close()
    steps = max(1, stats["steps"])
    return {"routed_step_ms": round(step_ms, 3),
            "routed_copy_ms_per_step": round(stats["copy_s"] / steps * 1e3, 3),
            "routed_bytes_per_step": int(stats["bytes"] / steps), "output": out}


def _median_ms(forward: Callable[[], torch.Tensor], reps: int, backend: PageBackend) -> tuple[float, torch.Tensor]:
    out = forward()  # warm-up (kernel selection, first touch)
    times = []
    for _ in range(reps):
        backend.synchronize()
        start = time.perf_counter()
        out = forward()
        backend.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), out
