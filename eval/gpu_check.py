#!/usr/bin/env python
"""The one GPU check (issue 10): the project's own page backend, expert stores, KV buffers, repartitioner
and staging engine on CUDA, in one call of under 5 minutes. Needs torch and cuda-bindings only: no
SGLang, no pyzmq (the report lists any such module that got imported, and fails if one did).

    python eval/gpu_check.py --require-gpu --json OUT.json  # a GPU machine; exit 2 without a usable GPU,
                                                           # exit 1 if any section fails
    python eval/gpu_check.py --dry-run                     # list the sections
    python eval/gpu_check.py --json OUT.json               # no GPU: the sections that run on host pages,
                                                           # at toy sizes (a smoke test of this script)

Sections (each reported separately; one failing does not stop the others):
  backend  CUDA page backend: expert pages move to a KV region and back, the KV tensor grows in place,
           every checksum survives, nothing leaks.
  driver   what the driver itself enforces, bypassing our bookkeeping (GPU only).
  remap    create / map (access set once per run) / unmap / release of 1 GiB of pages: ms per GiB, GiB/s.
  graphs   a few eligible MoE layers built with build_expert_stores, GrowableKVBuffers, Repartitioner and
           StagingEngine: torch.cuda.CUDAGraph segments captured with nothing offloaded (hooks live and
           called inside the capture, where they must do nothing), then offload(n) with the KV pool growing,
           the first eager forward, replayed segments with eager staging breaks (SGLang's breakable-graph
           protocol), and split w13/w2 waits, all bit for bit against the unpaged reference; one staging
           page read through every address it is mapped at; restore(n) with checksums equal; the
           Repartitioner's remap GiB/s; no page leaked.
  overlap  a Qwen3-Next-sized layer (512 experts, hidden 2048, expert intermediate 512, bf16, top-10),
           4 MoE layers of which 3 stage 25% of their experts: the fraction of staging hidden behind
           the MoE compute at decode batch 1, 16 and 64, from step times with and without offload and
           the engine's own copy-event times (GPU only; the host run uses toy sizes).
  routed   routed-only staging (issue 12): the device copy list captured once in a torch.cuda.CUDAGraph and
           replayed over new router ids (padding included), equal to the host-side runs; then eager
           steps under --vamp-staging routed, whole and auto over stale (finite) slots, and routed and whole
           steps alternating without after_moe (as under a graph replay), bit for bit against
           the unpaged reference, with a torch-only routed copier whose row count stays on the device (the
           host copy read through its mapped device pointer), the routed bytes read back from the device
           count, fewer bytes than whole, no page leaked. SGLang's gather kernel, which the server uses, is
           covered by tests/test_staging_routed_gpu.py (this script may not import SGLang).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from eval.gpu_sections import prefill_stream_timing, resize_rollback, side_stream_capture, state_pool_alloc
from vamp_sglang.memory.backend import BackendUnavailableError, PageBackend
from vamp_sglang.memory.backend_choice import select_backend
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.region import PagedRegion, bytes_checksum
from vamp_sglang.memory.repartition import Repartitioner
from vamp_sglang.memory.routed import device_copy_list, host_offset, routed_offloaded_runs
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores
from vamp_sglang.memory.state_buffers import GrowableStateBuffers, StateKind

MIB, GIB = 1 << 20, 1 << 30
HOST_GRAN = 64 << 10  # host runs: small pages keep the smoke test fast
KV_ROW_SHAPE = (8, 128)  # [kv heads, head dim] bf16: 2 KiB per token
FORBIDDEN_IMPORTS = ("sglang", "zmq")


# ---- backend and driver ------------------------------------------------------------------------------

def check_backend(backend: PageBackend, gpu: bool) -> dict:
    """Expert pages -> KV tail -> back, with checksums and an in-place grown KV tensor."""
    g = backend.granularity_bytes
    experts, kv = PagedRegion(backend, 16 * g), PagedRegion(backend, 24 * g)
    experts.append_new_pages(16)
    kv.append_new_pages(8)
    gen = torch.Generator(device=backend.device).manual_seed(0)
    expert_bytes = experts.view(torch.uint8, (16 * g,))
    expert_bytes.copy_(torch.randint(0, 256, (16 * g,), dtype=torch.uint8, device=backend.device, generator=gen))
    tokens_per_page = g // (2 * KV_ROW_SHAPE[0] * KV_ROW_SHAPE[1])
    k_buffer = kv.view(torch.bfloat16, (8 * tokens_per_page, *KV_ROW_SHAPE))
    k_buffer.fill_(3.0)
    holders, ptr = [k_buffer], k_buffer.data_ptr()
    expert_sums, kv_sums = experts.page_checksums(), kv.page_checksums()
    arena = backend.host_arena(8 * g)
    host_copy = arena.take(8 * g)
    host_copy.copy_(expert_bytes[8 * g:])

    backend.synchronize()
    moved = [experts.pop_tail() for _ in range(8)]  # high-index pages leave first
    kv.extend(moved)
    kv.regrow(k_buffer, (16 * tokens_per_page, *KV_ROW_SHAPE))
    result = {
        "same_tensor_object_grew": holders[0] is k_buffer and tuple(k_buffer.shape[:1]) == (16 * tokens_per_page,),
        "data_ptr_unchanged": k_buffer.data_ptr() == ptr,
        "moved_pages_carry_expert_bytes": kv.page_checksums()[8:] == expert_sums[8:][::-1],
        "kv_prefix_intact_after_grow": kv.page_checksums()[:8] == kv_sums,
        "host_copy_pinned_on_gpu_only": host_copy.is_pinned() == gpu,
    }
    k_buffer[8 * tokens_per_page:].fill_(-1.0)  # the KV now owns those pages
    backend.synchronize()
    result["resident_experts_intact"] = experts.page_checksums() == expert_sums[:8]
    result["new_kv_rows_written"] = bool((k_buffer[8 * tokens_per_page:] == -1.0).all())

    kv.regrow(k_buffer, (8 * tokens_per_page, *KV_ROW_SHAPE))
    backend.synchronize()
    back = [kv.pop_tail() for _ in range(8)]  # pages 8..15 in their original order
    experts.extend(back)
    expert_bytes[8 * g:].copy_(host_copy)  # restore = copy the pinned host copy back into the same VA
    backend.synchronize()
    result["experts_restored_exactly"] = experts.page_checksums() == expert_sums
    result["kv_prefix_intact_after_shrink"] = kv.page_checksums() == kv_sums
    for handle in experts.close() + kv.close():
        backend.release(handle)
    arena.close()
    counts = backend.live_counts()
    result["nothing_left_mapped_or_live"] = counts.mappings == counts.reservations == counts.handles == 0
    result["ok"] = all(result.values())
    return result


def probe_driver_rules(backend: PageBackend, gpu: bool) -> dict:
    """Call the raw primitives (driver calls, no bookkeeping) on rule-breaking inputs; record what happens."""
    g = backend.granularity_bytes
    base = backend.reserve(2 * g)
    h1, h2, h_double = backend.create(g), backend.create(g), backend.create(2 * g)
    result = {}
    backend._map_raw(base, h1)
    result["map_over_mapped_va"] = _attempt(lambda: backend._map_raw(base, h2), undo=lambda: None)
    backend._map_raw(base + g, h2)
    result["unmap_two_adjacent_mappings_in_one_call"] = _attempt(
        lambda: backend._unmap_raw(base, 2 * g),
        undo=lambda: (backend._unmap_raw(base, g), backend._unmap_raw(base + g, g)))
    backend._map_raw(base, h_double)
    result["unmap_sub_range_of_one_mapping"] = _attempt(
        lambda: backend._unmap_raw(base, g), undo=lambda: backend._unmap_raw(base, 2 * g))
    if result["unmap_sub_range_of_one_mapping"] == "accepted":
        backend._unmap_raw(base + g, g)
    backend.free_reservation(base, 2 * g)
    for h in (h1, h2, h_double):
        backend.release(h)
    return result  # a probe: it reports what the driver does and fails only if a call raises unexpectedly


def _attempt(call: Callable[[], None], undo: Callable[[], object]) -> str:
    """'refused: <error>' when the driver rejects the call (then `undo` cleans up), else 'accepted'."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - recording the driver's answer is the point
        undo()
        return f"refused: {exc}"
    return "accepted"


# ---- remap -------------------------------------------------------------------------------------------

def measure_remap(backend: PageBackend, gpu: bool) -> dict:
    """Create, map, unmap, remap elsewhere and release pages; times per GiB, data checked after the move."""
    g = backend.granularity_bytes
    nbytes, reps = (GIB, 3) if gpu else (64 * MIB, 1)
    n_pages = nbytes // g
    per_gib = GIB / (n_pages * g)
    rows: dict[str, list[float]] = {k: [] for k in ("create", "map", "unmap", "remap_map", "regrow", "release")}
    data_ok = True
    for rep in range(reps):
        src, dst = PagedRegion(backend, n_pages * g), PagedRegion(backend, n_pages * g)
        lap = _timer(backend)
        handles = [backend.create(g) for _ in range(n_pages)]
        rows["create"].append(lap())
        src.extend(handles)  # one run: access set once
        rows["map"].append(lap())
        src.view(torch.uint8, (n_pages * g,)).fill_(rep + 1)
        view = dst.view(torch.uint8, (0,))
        backend.synchronize()
        lap = _timer(backend)
        moved = [src.pop_tail() for _ in range(n_pages)]
        rows["unmap"].append(lap())
        dst.extend(moved[::-1])
        rows["remap_map"].append(lap())
        dst.regrow(view, (n_pages * g,))
        rows["regrow"].append(lap())
        data_ok &= bool((view == rep + 1).all())
        src.close()
        dst.close()
        lap = _timer(backend)
        for h in handles:
            backend.release(h)
        rows["release"].append(lap())
    result = {f"{k}_ms_per_gib": round(statistics.median(v) * 1e3 * per_gib, 3) for k, v in rows.items()}
    result["remap_ms_per_gib"] = round(result["unmap_ms_per_gib"] + result["remap_map_ms_per_gib"], 3)
    result["remap_gib_per_s"] = round(1e3 / result["remap_ms_per_gib"], 2) if result["remap_ms_per_gib"] else None
    result.update(pages=n_pages, page_bytes=g, reps=reps, data_survived_remap=data_ok, ok=data_ok)
    return result


def _timer(backend: PageBackend) -> Callable[[], float]:
    """Returns a callable giving seconds since the last call, after synchronizing the device."""
    last = [time.perf_counter()]

    def lap() -> float:
        backend.synchronize()
        now = time.perf_counter()
        elapsed, last[0] = now - last[0], now
        return elapsed

    return lap


# ---- the MoE forward both sections use -----------------------------------------------------------------

def moe_layer(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              between: Callable[[], None] | None = None) -> torch.Tensor:
    """Grouped expert MLP: x [E, T, H], w13 [E, 2I, H], w2 [E, H, I] -> [E, T, H] (SiLU-gated).
    `between` runs after the gate-up GEMM (the split w2 wait, paper V-B)."""
    gate_up = torch.bmm(x, w13.transpose(1, 2))  # [E, T, 2I]
    inter = gate_up.shape[-1] // 2
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]  # [E, T, I]
    if between is not None:
        between()
    return torch.bmm(act, w2.transpose(1, 2))  # [E, T, H]


def routed_moe(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               between: Callable[[], None] | None = None) -> torch.Tensor:
    """Top-k MoE with static shapes and no host sync (capturable): every expert runs, the routing
    weights are zero off the top-k. x [T, H] -> [T, H]; reads every expert, offloaded ones included."""
    weights, ids = torch.topk(torch.softmax(x @ router.T, dim=-1), top_k)
    dense = torch.zeros(x.shape[0], router.shape[0], dtype=x.dtype, device=x.device).scatter_(1, ids, weights)
    out = moe_layer(x.unsqueeze(0).expand(router.shape[0], -1, -1).contiguous(), w13, w2, between)
    return (dense.T.unsqueeze(-1) * out).sum(0)


def _toy_layers(backend: PageBackend, layer_ids: list[int], experts: int, hidden: int, inter: int,
                dtype: torch.dtype, gen: torch.Generator) -> tuple[dict, ExpertLayout]:
    """{layer: (w13, w2, router)} with random weights, and their layout with up to half offloadable."""
    dev = backend.device
    weights = {lid: (torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen, dtype=dtype) / 32,
                     torch.randn(experts, hidden, inter, device=dev, generator=gen, dtype=dtype) / 16,
                     torch.randn(experts, hidden, device=dev, generator=gen, dtype=dtype)) for lid in layer_ids}
    w13_0 = weights[layer_ids[0]][0]
    layout = ExpertLayout.compute(layer_ids, experts, w13_0[0].numel() * w13_0.element_size(),
                                  weights[layer_ids[0]][1][0].numel() * w13_0.element_size(),
                                  backend.granularity_bytes, 0.5, experts)
    return weights, layout


# ---- graphs: the real stores, KV buffers, repartitioner and staging engine --------------------------------

def check_graphs(backend: PageBackend, gpu: bool) -> dict:
    """Paged layers under captured graph segments, offload and restore, bit for bit against unpaged."""
    dev, dtype = backend.device, (torch.bfloat16 if gpu else torch.float32)
    experts, hidden, inter, tokens, top_k = (64, 1024, 512, 8, 4) if gpu else (16, 128, 64, 8, 4)
    layer_ids = [0, 1, 2, 3]
    gen = torch.Generator(device=dev).manual_seed(1)
    weights, layout = _toy_layers(backend, layer_ids, experts, hidden, inter, dtype, gen)
    before = backend.live_counts()
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    kv = GrowableKVBuffers.for_layout(backend, layout, 2, *KV_ROW_SHAPE, dtype, initial_rows=1024)
    for i, t in enumerate(kv.k_buffers + kv.v_buffers):
        t.copy_(torch.randn(t.shape, device=dev, generator=gen, dtype=dtype) + i)
    live_rows = kv.row_capacity
    engine = StagingEngine(stores, "async")
    rp = Repartitioner(layout, stores, kv, lambda old, new, pool_tokens: None, tail_is_free=lambda lo, hi: lo >= live_rows,
                       staging=engine)
    paged = {s.layer_id: (s.w13, s.w2) for s in stores}
    x0 = torch.randn(tokens, hidden, device=dev, generator=gen, dtype=dtype)

    def layer_forward(lid: int, x: torch.Tensor, eng: StagingEngine | None = None) -> torch.Tensor:
        w13, w2 = paged.get(lid, weights[lid][:2])  # the first MoE layer stays on its own tensors
        between = (lambda: eng.before_down_proj(lid)) if eng is not None and eng.split_w2_wait else None
        return x + routed_moe(x, weights[lid][2], w13, w2, top_k, between)

    def eager(eng: StagingEngine) -> torch.Tensor:
        x = x0.clone()
        eng.begin_forward()
        for lid in layer_ids:
            eng.before_moe(lid)
            x = layer_forward(lid, x, eng)
            eng.after_moe(lid)
        return x

    x = x0.clone()
    for lid in layer_ids:  # the unpaged reference
        x = x + routed_moe(x, weights[lid][2], *weights[lid][:2], top_k)
    reference = x
    kv_sums = kv.checksums(live_rows)
    expert_sums = [s.expert_checksums(0, experts) for s in stores]
    result = {"eager_exact_before_offload": torch.equal(eager(engine), reference)}

    segments = _capture_segments(layer_ids, layer_forward, engine, x0, result) if gpu else None
    groups = layout.bound_groups // 2
    pool_before = kv.row_capacity
    rp.offload(groups)
    result["kv_pool_grew"] = kv.row_capacity > pool_before
    if gpu:  # item 1: hooks called inside a capture while experts are offloaded leave no captured event
        result["hooks_idle_while_capturing"] = _capture_with_hooks(engine, layer_forward, x0, stores[0].layer_id)
    result["first_eager_forward_after_offload_exact"] = torch.equal(eager(engine), reference)
    if segments is not None:
        _poison_slots(stores)
        replayed = _replay(segments, layer_ids, engine)
        result["replay_after_offload_exact"] = torch.equal(replayed, reference)
        result["replay_max_abs_diff"] = float((replayed.float() - reference.float()).abs().max())
        result["replay_again_exact"] = torch.equal(_replay(segments, layer_ids, engine), reference)
    split = StagingEngine(stores, "async", split_w2_wait=True)
    _poison_slots(stores)
    result["split_w2_wait_exact"] = torch.equal(eager(split), reference)
    split.close()
    result["one_page_same_through_every_address"] = _read_alias_page(backend, staging, stores, groups)
    stats = engine.stats()
    rp.restore(groups)
    result["experts_restored_exactly"] = [s.expert_checksums(0, experts) for s in stores] == expert_sums
    result["live_kv_rows_intact"] = kv.checksums(live_rows) == kv_sums
    result["eager_exact_after_restore"] = torch.equal(eager(engine), reference)
    rep = rp.stats()
    result.update(offloaded_groups=groups, staging_copies=stats.copies, staging_copy_s=round(stats.copy_s, 6),
                  staging_stalls=stats.stalls, pinned_bytes=staging.pinned_bytes,
                  remapped_bytes=rep.remapped_bytes, remap_gib_per_s=round(rep.remap_gib_per_s, 2))
    engine.close()
    rp.close()
    kv.close()
    close_expert_stores(staging, stores)
    result["no_page_leaked"] = backend.live_counts() == before
    result["ok"] = all(v for v in result.values() if isinstance(v, bool))
    return result


def _capture_segments(layer_ids: list[int], layer_forward, engine: StagingEngine, x0: torch.Tensor,
                      result: dict) -> dict:
    """One CUDAGraph per layer, captured with nothing offloaded while the staging hooks are called
    inside the capture (they must do nothing there: issue 10 item 1). Replay runs `before_moe` eagerly
    between segments, as SGLang's breakable graphs run an `eager_on_graph` break."""
    static = {"x": x0.clone()}
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch requires
        for lid in layer_ids:
            layer_forward(lid, static["x"], engine)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = {}, {}
    x = static["x"]
    for lid in layer_ids:
        graphs[lid] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[lid], pool=pool):
            engine.before_moe(lid)  # capturing: must record and wait on nothing
            outs[lid] = layer_forward(lid, x, engine)
            engine.after_moe(lid)
        x = outs[lid]
    torch.cuda.synchronize()
    return {"static": static, "graphs": graphs, "out": outs[layer_ids[-1]]}


def _capture_with_hooks(engine: StagingEngine, layer_forward, x0: torch.Tensor, layer_id: int) -> bool:
    """Capture one layer with every hook called inside, experts offloaded: nothing may be staged,
    counted or recorded (an event recorded there would be a graph node the next eager wait trips on)."""
    before = engine.stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        engine.begin_forward()
        engine.before_moe(layer_id)
        layer_forward(layer_id, x0, engine)
        engine.after_moe(layer_id)
    torch.cuda.synchronize()
    after = engine.stats()
    return (after.copies, after.steps, after.timed_copies) == (before.copies, before.steps, before.timed_copies)


def _replay(segments: dict, layer_ids: list[int], engine: StagingEngine) -> torch.Tensor:
    """The `_forward_raw` hook, then segment / eager break / segment ... on the current stream."""
    engine.begin_forward()
    for lid in layer_ids:
        engine.before_moe(lid)  # the eager break
        segments["graphs"][lid].replay()
    return segments["out"].clone()


def _poison_slots(stores) -> None:
    """Make every staging slot stale, so only a staging copy can make an output exact. The fill runs on
    the compute stream, which the copy stream is not ordered after: finish it before any copy is issued."""
    for store in stores:
        for dst, _ in store.staging_pairs():
            dst.fill_(float("nan"))
    stores[0].backend.synchronize()


def _read_alias_page(backend: PageBackend, staging, stores, groups: int) -> bool:
    """The staging slot-0 w13 page behind the lowest offloaded page is mapped in the slot and in every
    slot-0 layer's offloaded range; its bytes must read the same through each address."""
    g, lay = backend.granularity_bytes, stores[0].layout
    offloaded_pages = groups * lay.w13_group_pages
    addrs = [staging.slots[0]._regions[0].base + (lay.bound_groups * lay.w13_group_pages - offloaded_pages) * g]
    for store in stores[0::2]:  # eligible index 0, 2, ... read slot 0
        weight = store._w13
        addrs.append(weight.base + (weight.pages - offloaded_pages) * g)
    sums = {bytes_checksum(backend.tensor(a, g, torch.uint8, (g,))) for a in addrs}
    return len(addrs) >= 2 and len(sums) == 1


# ---- overlap: staging hidden behind compute at decode batch sizes ---------------------------------------

def measure_overlap(backend: PageBackend, gpu: bool) -> dict:
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
        for store in stores:
            store.restore_tail(None, layout.bound_groups)
    result["staged_bytes_per_layer"] = stores[0].layout.offloadable_experts * sum(shard)
    result["pinned_bytes"] = staging.pinned_bytes
    result["outputs_exact"] = outputs_exact
    result["ok"] = outputs_exact and all(b["hidden_fraction"] is not None for b in result["batches"])
    engine.close()
    close_expert_stores(staging, stores)
    return result


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


# ---- routed: routed-only staging with a device-side copy list (issue 12) ----------------------------------

def check_routed(backend: PageBackend, gpu: bool) -> dict:
    """Routed-only staging: device copy list captured in a CUDA graph, then eager steps in every mode."""
    dev, dtype = backend.device, (torch.bfloat16 if gpu else torch.float32)
    experts, hidden, inter, top_k = (64, 1024, 512, 4) if gpu else (16, 128, 64, 2)
    layer_ids = [0, 1, 2, 3]
    gen = torch.Generator(device=dev).manual_seed(3)
    weights, layout = _toy_layers(backend, layer_ids, experts, hidden, inter, dtype, gen)
    before = backend.live_counts()
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    for store in stores:
        for handle in store.offload_tail_pages(layout.bound_groups):
            backend.release(handle)
    boundary = stores[0].boundary_expert
    result: dict = {"offloaded_experts": experts - boundary, "copy_list_in_graph": _copy_list_graph(
        stores[0], top_k, gen) if gpu else None}
    copier = _UvaCopier(stores) if gpu else None
    paged = {s.layer_id: (s.w13, s.w2) for s in stores}

    def forward(x: torch.Tensor, eng: StagingEngine | None, replayed: bool = False) -> torch.Tensor:
        """`replayed`: no after_moe, as under a graph replay (only the breaks run)."""
        if eng is not None:
            eng.begin_forward(x.shape[0])
        for lid in layer_ids:
            w13, w2 = paged.get(lid, weights[lid][:2]) if eng is not None else weights[lid][:2]
            ids = torch.topk(torch.softmax(x @ weights[lid][2].T, dim=-1), top_k)[1]
            if eng is not None:
                eng.before_moe(lid, ids)
            x = x + routed_moe(x, weights[lid][2], w13, w2, top_k)  # reads every row: stale ones weigh 0
            if eng is not None and not replayed:
                eng.after_moe(lid)
        return x

    for policy in ("routed", "whole", "auto"):
        engine = StagingEngine(stores, "async", staging=policy, top_k=top_k, routed_copier=copier)
        exact = []
        for step, tokens in enumerate((1, 4, 16, 1, 4)):
            _stale_slots(stores)
            x = torch.randn(tokens, hidden, device=dev, generator=gen, dtype=dtype)
            exact.append(torch.equal(forward(x, engine), forward(x, None)))
            if step == 0 and policy == "routed":
                backend.synchronize()
                want = _routed_rows(x, weights, layer_ids[1:], top_k, boundary) * _row_bytes(stores[0])
                stats = engine.stats()
                result["routed_bytes_counted_on_device"] = stats.by_mode["routed"]["bytes"] == want
        backend.synchronize()
        stats = engine.stats()
        result[f"{policy}_exact"] = all(exact)
        result[f"{policy}_steps_by_mode"] = {m: v["steps"] for m, v in stats.by_mode.items()}
        result[f"{policy}_bytes_by_mode"] = {m: v["bytes"] for m, v in stats.by_mode.items()}
        engine.close()
    engine = StagingEngine(stores, "async", staging="routed", top_k=top_k, routed_copier=copier)
    xs, outs = [torch.randn(4, hidden, device=dev, generator=gen, dtype=dtype) for _ in range(6)], []
    for step, x in enumerate(xs):  # routed and whole steps alternate, no after_moe and no sync in between:
        engine.chooser.policy = ("routed", "whole")[step % 2]  # each prefetch must still follow the slot's
        outs.append(forward(x, engine, replayed=True))  # last reader, a routed layer's MoE kernel
    exact = [torch.equal(out, forward(x, None)) for x, out in zip(xs, outs, strict=True)]
    backend.synchronize()
    engine.close()
    result["modes_alternate_without_after_moe_exact"] = all(exact)
    result["routed_stages_fewer_bytes"] = (result["routed_bytes_by_mode"]["routed"]
                                           < result["whole_bytes_by_mode"]["whole"])
    close_expert_stores(staging, stores)
    result["no_page_leaked"] = backend.live_counts() == before
    result["ok"] = all(v for v in result.values() if isinstance(v, bool)) and result["copy_list_in_graph"] in (None, True)
    return result


def _copy_list_graph(store, top_k: int, gen: torch.Generator) -> bool:
    """`device_copy_list` captured once in a CUDA graph, replayed over new router ids written in place:
    each replay's list equals the host-side runs (no host read inside, so the capture is legal)."""
    dev, experts = store.w13.device, store.w13.shape[0]
    boundary, offset, rows = store.boundary_expert, host_offset(store), store.host_w13.shape[0]
    topk = torch.zeros(16, top_k, dtype=torch.int32, device=dev)
    src, dst = (torch.zeros(rows, dtype=torch.int32, device=dev) for _ in range(2))
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    device_copy_list(topk, boundary, experts, offset, src, dst, count)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        device_copy_list(topk, boundary, experts, offset, src, dst, count)
    ok = True
    for tokens in (1, 4, 16):
        ids = torch.randint(0, experts, (16, top_k), device=dev, generator=gen, dtype=torch.int32)
        ids[tokens:] = -1  # padded rows of a graph batch
        topk.copy_(ids)
        graph.replay()
        torch.cuda.synchronize(dev)
        want = [e for first, end in routed_offloaded_runs(ids.cpu(), boundary, experts) for e in range(first, end)]
        n = int(count.item())
        ok &= dst[:n].tolist() == want and src[:n].tolist() == [e - offset for e in want]
    return ok


class _UvaCopier:
    """A torch-only routed copier for this check (the server uses SGLang's gather, which this script may
    not import): the copy list is built on the device, the host copy is read through its mapped device
    pointer, and every entry past the count copies an offloaded row onto itself from its own host row,
    so the work has a fixed shape and needs no host read of the count."""

    def __init__(self, stores) -> None:
        from cuda.bindings import driver

        self._views = {}
        for store in stores:
            views = []
            for host in (store.host_w13, store.host_w2):
                err, ptr = driver.cuMemHostGetDevicePointer(host.data_ptr(), 0)
                if err != driver.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuMemHostGetDevicePointer: {err}")
                storage = torch._C._construct_storage_from_data_pointer(
                    int(ptr), store.w13.device, host.numel() * host.element_size())
                views.append(torch.empty(0, dtype=host.dtype, device=store.w13.device).set_(storage, 0, host.shape))
            rows = store.host_w13.shape[0]
            self._views[store.layer_id] = (views, *(torch.zeros(rows, dtype=torch.int32, device=store.w13.device)
                                                    for _ in range(2)),
                                           torch.zeros(1, dtype=torch.int32, device=store.w13.device))

    def __call__(self, store, topk_ids: torch.Tensor) -> torch.Tensor:
        views, src, dst, count = self._views[store.layer_id]
        experts, boundary = store.w13.shape[0], store.boundary_expert
        device_copy_list(topk_ids, boundary, experts, host_offset(store), src, dst, count)
        n = experts - boundary
        live = torch.arange(n, device=count.device) < count
        d = torch.where(live, dst[:n], dst[0]).long()
        s = torch.where(live, src[:n], src[0]).long()
        for tensor, host in zip((store.w13, store.w2), views, strict=True):
            tensor.index_copy_(0, d, host.index_select(0, s))
        return count


def _stale_slots(stores) -> None:
    """Finite stale values in every offloaded row, so only a staging copy makes a routed row right."""
    for store in stores:
        for dst, _ in store.staging_pairs():
            dst.fill_(7.0)
    stores[0].backend.synchronize()


def _routed_rows(x: torch.Tensor, weights: dict, layer_ids: list[int], top_k: int, boundary: int) -> int:
    """Distinct routed offloaded rows of the eligible layers in an eager forward of x (reference weights)."""
    rows = 0
    for lid in [0, *layer_ids]:
        ids = torch.topk(torch.softmax(x @ weights[lid][2].T, dim=-1), top_k)[1]
        if lid in layer_ids:
            runs = routed_offloaded_runs(ids.cpu(), boundary, weights[lid][0].shape[0])
            rows += sum(end - first for first, end in runs)
        x = x + routed_moe(x, weights[lid][2], *weights[lid][:2], top_k)
    return rows


def _row_bytes(store) -> int:
    return store.w13[0].numel() * store.w13.element_size() + store.w2[0].numel() * store.w2.element_size()


def check_state(backend: PageBackend, gpu: bool) -> dict:
    """Layer-strided linear-attention state tensors (Qwen3-Next TP2 shapes): every layer grows at its tail
    in place; SGLang's slot clear and copy (`index_fill_`, `t[:, dst] = t[:, src]`) on the strided view."""
    kinds = [StateKind((4096, 3), torch.bfloat16), StateKind((16, 128, 128), torch.float32)]  # 24 KiB, 1 MiB
    state = GrowableStateBuffers(backend, kinds, layers=4, initial_rows=5, max_rows=64)
    conv, ssm = state.tensors
    ptrs = [t.data_ptr() for t in state.tensors]
    for t in state.tensors:
        for layer in range(4):
            t[layer].fill_(layer + 1.0)
    before = state.checksums()
    grow = state.pages_for(20) - state.pages_for(5)
    state.grow_to(20, [backend.create(backend.granularity_bytes) for _ in range(grow)])
    ssm[:, 5:].fill_(-1.0)
    ssm.index_fill_(1, torch.tensor([19], device=backend.device), 7.0)  # MambaPool.clear_slots
    conv[:, torch.tensor([18], device=backend.device)] = conv[:, torch.tensor([2], device=backend.device)]
    backend.synchronize()
    result = {
        "same_objects_same_addresses": [t.data_ptr() for t in state.tensors] == ptrs and ssm.shape[1] == 20,
        "old_rows_intact": state.checksums(5) == before,
        "layer_views_contiguous": all(t[layer].is_contiguous() for t in state.tensors for layer in range(4)),
        "slot_clear_hits_every_layer": bool((ssm[:, 19] == 7.0).all()) and bool((ssm[:, 18] == -1.0).all()),
        "slot_copy_per_layer": all(bool((conv[layer, 18] == layer + 1.0).all()) for layer in range(4)),
    }
    tail = ssm[3, 19].data_ptr()
    for handle in state.shrink_to(5):
        backend.release(handle)
    result["shrunk_exactly"] = state.checksums() == before and not backend.is_mapped(tail, 4)
    state.close()
    counts = backend.live_counts()
    result["nothing_left_mapped_or_live"] = counts.mappings == counts.reservations == counts.handles == 0
    result["ok"] = all(result.values())
    return result


# ---- driver ------------------------------------------------------------------------------------------

SECTIONS: dict[str, tuple[bool, Callable[[PageBackend, bool], dict]]] = {  # name -> (GPU only, check)
    "backend": (False, check_backend),
    "driver": (True, probe_driver_rules),
    "remap": (False, measure_remap),
    "graphs": (False, check_graphs),
    "overlap": (False, measure_overlap),
    "routed": (False, check_routed),
    "state": (False, check_state),
    "prefill_stream": (True, prefill_stream_timing.check),
    "side_stream_capture": (True, side_stream_capture.check),
    "resize_rollback": (False, resize_rollback.check),
    "state_pool_alloc": (False, state_pool_alloc.check),
}


def run_section(report: dict, name: str, fn: Callable[[], dict]) -> None:
    start = time.perf_counter()
    try:
        report[name] = fn()
    except Exception:  # noqa: BLE001 - one broken section must not hide the others' results
        report[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    report[name]["seconds"] = round(time.perf_counter() - start, 2)


def cuda_backend_or_reason() -> tuple[PageBackend | None, str]:
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    try:
        return select_backend("cuda", torch.device("cuda", 0)), ""
    except BackendUnavailableError as exc:
        return None, str(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list the sections and exit")
    parser.add_argument("--require-gpu", action="store_true",
                        help="exit 2 at once without a usable GPU instead of running the host sections")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.dry_run:
        for name, (gpu_only, fn) in SECTIONS.items():
            doc = (fn.__doc__ or "").strip().split("\n")[0]
            print(f"{name:8s} {'GPU only' if gpu_only else 'GPU (host pages without one)':28s} {doc}")
        return 0
    backend, reason = cuda_backend_or_reason()
    if backend is None and args.require_gpu:
        print(f"gpu_check: no usable GPU ({reason}); --require-gpu runs nothing on the host", file=sys.stderr)
        return 2
    gpu = backend is not None
    if backend is None:
        backend = select_backend("host", "cpu", granularity_bytes=HOST_GRAN)
    report: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if gpu else None,
                    "status": "ran on GPU" if gpu else f"no GPU ({reason}): host pages, toy sizes",
                    "granularity_bytes": backend.granularity_bytes}
    for name, (gpu_only, fn) in SECTIONS.items():
        if gpu_only and not gpu:
            report[name] = {"skipped": "needs a GPU"}
            continue
        run_section(report, name, lambda fn=fn: fn(backend, gpu))
    backend.close()
    report["forbidden_imports"] = sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN_IMPORTS))
    failed = [name for name in SECTIONS if report[name].get("ok") is False]
    failed += ["forbidden_imports"] if report["forbidden_imports"] else []
    report["failed_sections"] = failed
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
