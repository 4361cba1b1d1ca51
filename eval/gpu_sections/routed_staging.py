"""gpu_check section `routed`: routed-only staging (issue 12). The device copy list captured once in a
torch.cuda.CUDAGraph and replayed over new router ids (padding included) equals the host-side runs; then
eager steps under --vamp-staging routed, whole and auto over stale (finite) slots, and routed and whole
steps alternating without after_moe (as under a graph replay), bit for bit against the unpaged forward
(eager against eager: the same kernels), with a torch-only routed copier whose row count stays on the
device (the host copy read through its mapped device pointer); the routed bytes read back from the device
count, fewer bytes than whole, no page leaked. All of it with bf16 experts, then (under "fp8", issue 20) with
the same experts in block FP8: routed rows and bytes are FP8 rows, the scales stay resident. SGLang's gather kernel, which the server uses, is covered by
tests/test_staging_routed_gpu.py (this script may not import SGLang)."""

from __future__ import annotations

import torch

from eval.gpu_sections.toy_moe import fill_slots, routed_moe, toy_layers
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.routed import device_copy_list, host_offset, routed_offloaded_runs
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores


def check(backend: PageBackend, gpu: bool) -> dict:
    """Routed-only staging: device copy list captured in a CUDA graph, then eager steps in every mode;
    bf16 experts, then FP8 experts with block scales."""
    result = _check(backend, gpu, fp8=False)
    result["fp8"] = _check(backend, gpu, fp8=True)
    result["ok"] = result["ok"] and result["fp8"]["ok"]
    return result


def _check(backend: PageBackend, gpu: bool, fp8: bool) -> dict:
    dev, dtype = backend.device, (torch.bfloat16 if gpu else torch.float32)
    experts, hidden, inter, top_k = (64, 1024, 512, 4) if gpu else (16, 128, 128 if fp8 else 64, 2)
    layer_ids = [0, 1, 2, 3]
    gen = torch.Generator(device=dev).manual_seed(3)
    weights, layout = toy_layers(backend, layer_ids, experts, hidden, inter, dtype, gen, fp8=fp8)
    before = backend.live_counts()
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    for store in stores:
        for handle in store.offload_tail_pages(layout.bound_groups):
            backend.release(handle)
    boundary = stores[0].boundary_expert
    result: dict = {"offloaded_experts": experts - boundary, "copy_list_in_graph": _copy_list_graph(
        stores[0], top_k, gen) if gpu else None}
    copier = UvaCopier(stores) if gpu else None
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
            x = x + routed_moe(x, weights[lid][2], w13, w2, top_k, scales=weights[lid][3:])  # every row read
            if eng is not None and not replayed:
                eng.after_moe(lid)
        return x

    for policy in ("routed", "whole", "auto"):
        engine = StagingEngine(stores, "async", staging=policy, top_k=top_k, routed_copier=copier)
        exact = []
        for step, tokens in enumerate((1, 4, 16, 1, 4)):
            fill_slots(stores, 7.0)  # finite stale rows: only a staging copy makes a routed row right
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


class UvaCopier:
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
            copy_rows(tensor, host, d, s)
        return count


def copy_rows(tensor: torch.Tensor, host: torch.Tensor, dst_rows: torch.Tensor, src_rows: torch.Tensor) -> None:
    """`tensor[dst_rows] = host[src_rows]` as bytes: index_copy_ has no FP8 kernel (CUDA or CPU), and a
    byte copy is what the server's gather does too."""
    tensor.view(torch.uint8).index_copy_(0, dst_rows, host.view(torch.uint8).index_select(0, src_rows))


def _routed_rows(x: torch.Tensor, weights: dict, layer_ids: list[int], top_k: int, boundary: int) -> int:
    """Distinct routed offloaded rows of the eligible layers in an eager forward of x (reference weights)."""
    rows = 0
    for lid in [0, *layer_ids]:
        ids = torch.topk(torch.softmax(x @ weights[lid][2].T, dim=-1), top_k)[1]
        if lid in layer_ids:
            runs = routed_offloaded_runs(ids.cpu(), boundary, weights[lid][0].shape[0])
            rows += sum(end - first for first, end in runs)
        x = x + routed_moe(x, weights[lid][2], *weights[lid][:2], top_k, scales=weights[lid][3:])
    return rows


def _row_bytes(store) -> int:
    return store.w13[0].numel() * store.w13.element_size() + store.w2[0].numel() * store.w2.element_size()
