"""gpu_check section `host_experts`: `--vamp-staging host` on a GPU (issue 49,
integration/staging/host_experts_cuda.py), the server's own round trip (`HostRoundTrip` over `CudaCopies`:
snapshot and mask, D2H on a side stream into pinned buffers, the CPU's `cold_output` from the host copy,
H2D, add) between captured segments, as SGLang's breakable graphs replay the breaks between theirs.

Correctness, on one small eligible layer over paged experts with its offloadable groups offloaded and
its staging slots NaN (so a kernel that read an offloaded row would show it), at batch 1, 4 and 16, one
graph per batch as SGLang captures per batch size; each graph is router segment, `send`, kernel segment
(a capturable torch MoE that skips -1 ids, `gathered_moe`), `add`, residual segment:
- `replay_close_to_resident`: the replay equals the layer over its unpaged weights within bf16 rounding
  (the host half is summed apart); `replay_again_exact`: a second replay is bit for bit the first;
- `replay_without_breaks_reads_nan`: the control, the segments alone read the offloaded rows.

Timings, on a Qwen3-Next-sized layer (512 experts, hidden 2048, expert intermediate 512, top-10, bf16,
25% offloaded) at decode batch 1, 16 and 64: the router's real ids (random weights: near-uniform) go the
whole round trip, while the captured resident segment is a grouped GEMM over as many resident experts as
the batch routes (the `overlap` section's stand-in for SGLang's Triton MoE, which this script may not
import): `d2h_us` and `h2d_us` (timing events on the side stream), `cpu_ms` (the host half, wall clock,
`torch_threads` threads, as many as the server's `host_threads`), `resident_ms` (the segment alone), `step_ms` (send, segment, add), and
`overlap_fraction`, the share of D2H + CPU + H2D hidden behind the resident segment:
(resident + host side - step) / host side, clipped to [0, 1]. These are what the decode-cost model's host
side assumes (eval/decode_cost_model.py: 10 us a direction, this machine's per-core expert time scaled).

Without a GPU the same round trip runs eagerly over host pages at toy sizes (`PlainCopies`); its timings
mean nothing for a GPU."""

from __future__ import annotations

import math
import statistics
import time

import torch

from eval.gpu_sections.routing_order_graph import gathered_moe
from eval.gpu_sections.toy_moe import fill_slots, moe_layer, toy_layers
from vamp_sglang.integration.staging.host_experts import HostExpertStats
from vamp_sglang.integration.staging.host_experts_cuda import CudaCopies, HostRoundTrip, host_threads
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores


class PlainCopies:
    """The round trip's copies without CUDA (the host smoke run): plain buffers, each copy done at once."""

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    device_buffer = host_buffer

    def refuse_capture(self) -> None:
        """Nothing is captured on the host."""

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def wait_host(self) -> None:
        """The copies are done."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def idle(self) -> None:
        """No copy is in flight."""

    def copy_ms(self) -> tuple[None, None]:
        return None, None


def check(backend: PageBackend, gpu: bool) -> dict:
    """Host-computed cold experts between captured segments: replays equal the resident layer; D2H, CPU,
    H2D, resident and step times with the overlap fraction at batch 1, 16, 64 (Qwen3-Next-sized layer)."""
    result = {"graphs": _graphs(backend, gpu), "timing": _timing(backend, gpu)}
    result["ok"] = result["graphs"]["ok"] and result["timing"]["ok"]
    return result


def _copies(backend: PageBackend, gpu: bool) -> CudaCopies | PlainCopies:
    return CudaCopies(backend.device, timed=True) if gpu else PlainCopies()


def _graphs(backend: PageBackend, gpu: bool) -> dict:
    dev, dtype = backend.device, (torch.bfloat16 if gpu else torch.float32)
    experts, hidden, inter, top_k = (64, 1024, 512, 4) if gpu else (16, 128, 64, 2)
    gen = torch.Generator(device=dev).manual_seed(5)
    weights, layout = toy_layers(backend, [0, 1], experts, hidden, inter, dtype, gen)
    before = backend.live_counts()
    staging, stores = build_expert_stores(backend, layout, {1: weights[1][:2]})
    for handle in stores[0].offload_tail_pages(layout.bound_groups):
        backend.release(handle)
    fill_slots(stores, float("nan"))
    trip = HostRoundTrip(_copies(backend, gpu), HostExpertStats())
    batches = [_graph_batch(backend, gpu, trip, stores[0], weights[1],
                            torch.randn(tokens, hidden, device=dev, generator=gen, dtype=dtype), top_k)
               for tokens in (1, 4, 16)]
    result = {"offloaded_experts": experts - stores[0].boundary_expert, "batches": batches,
              "host_pairs": trip.stats.pairs}
    close_expert_stores(staging, stores)
    result["no_page_leaked"] = backend.live_counts() == before
    result["ok"] = result["no_page_leaked"] and result["host_pairs"] > 0 and all(
        v for b in batches for v in b.values() if isinstance(v, bool))
    return result


def _graph_batch(backend: PageBackend, gpu: bool, trip: HostRoundTrip, store, weights: tuple,
                 x: torch.Tensor, top_k: int) -> dict:
    """One batch size's graph: router, send, kernel, add, residual; replays against the resident layer."""
    w13, w2, router = weights
    gates = torch.zeros(x.shape[0], top_k, device=x.device)
    ids = torch.zeros(x.shape[0], top_k, device=x.device, dtype=torch.int64)
    out, y = torch.zeros_like(x), torch.zeros_like(x)

    def route() -> None:
        g, i = torch.topk(torch.softmax(x.float() @ router.float().T, dim=-1), top_k)
        gates.copy_(g)
        ids.copy_(i)

    segments = [route, lambda: out.copy_(gathered_moe(x, gates, ids, store.w13, store.w2)),
                lambda: y.copy_(x + out)]
    route()
    want = x + gathered_moe(x, gates, ids, w13, w2)  # the resident layer
    runs = [g.replay for g in _capture(segments)] if gpu else segments

    def step(breaks: bool = True) -> torch.Tensor:
        for i, run in enumerate(runs):
            run()
            if breaks and i == 0:
                trip.send(store, True, x, ids, gates)
            elif breaks and i == 1:
                trip.add(out)
        backend.synchronize()
        return y.clone()

    first, second = step(), step()
    bound = 2e-2 * float(want.abs().max()) if gpu else 1e-5
    return {"batch": x.shape[0], "replay_close_to_resident": float((first - want).abs().max()) <= bound,
            "replay_again_exact": torch.equal(first, second),
            "replay_without_breaks_reads_nan": not bool(step(breaks=False).isfinite().all())}


def _timing(backend: PageBackend, gpu: bool) -> dict:
    dev, dtype = backend.device, (torch.bfloat16 if gpu else torch.float32)
    experts, hidden, inter, top_k = (512, 2048, 512, 10) if gpu else (16, 128, 64, 2)
    gen = torch.Generator(device=dev).manual_seed(6)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen, dtype=dtype) / 32
    w2 = torch.randn(experts, hidden, inter, device=dev, generator=gen, dtype=dtype) / 16
    router = torch.randn(experts, hidden, device=dev, generator=gen, dtype=dtype)
    layout = ExpertLayout.compute([0, 1], experts, w13[0].numel() * w13.element_size(),
                                  w2[0].numel() * w2.element_size(), backend.granularity_bytes, 0.25, experts)
    before = backend.live_counts()
    staging, stores = build_expert_stores(backend, layout, {1: (w13, w2)})
    del w13, w2
    for handle in stores[0].offload_tail_pages(layout.bound_groups):
        backend.release(handle)
    trip = HostRoundTrip(_copies(backend, gpu), HostExpertStats(), host_threads() if gpu else None)
    batches = [_timing_batch(backend, gpu, trip, stores[0], router,
                             torch.randn(batch, hidden, device=dev, generator=gen, dtype=dtype), top_k, gen)
               for batch in (1, 16, 64)]
    result = {"experts": experts, "hidden": hidden, "expert_intermediate": inter, "top_k": top_k,
              "offloaded_experts": experts - stores[0].boundary_expert, "torch_threads": trip.threads or torch.get_num_threads(),
              "batches": batches}
    close_expert_stores(staging, stores)
    result["no_page_leaked"] = backend.live_counts() == before
    result["ok"] = result["no_page_leaked"] and sum(b["cold_pairs_per_step"] for b in batches) > 0 and all(
        b["overlap_fraction"] is not None for b in batches)
    return result


def _timing_batch(backend: PageBackend, gpu: bool, trip: HostRoundTrip, store, router: torch.Tensor,
                  x: torch.Tensor, top_k: int, gen: torch.Generator, reps: int = 10) -> dict:
    """Median times of one batch size over `reps` steps after a warm-up (2 on the host)."""
    reps = reps if gpu else 2
    experts = store.routed_experts
    used = max(1, round(store.boundary_expert * (1 - (1 - top_k / experts) ** x.shape[0])))  # resident, routed
    grouped = torch.randn(used, math.ceil(x.shape[0] * top_k / used), x.shape[1], device=x.device, generator=gen,
                          dtype=x.dtype)
    gates, ids = torch.topk(torch.softmax(x.float() @ router.float().T, dim=-1), top_k)
    out = torch.zeros_like(x)
    kernel = [lambda: moe_layer(grouped, store.w13[:used], store.w2[:used])]
    run = _capture(kernel)[0].replay if gpu else kernel[0]
    rows: dict[str, list] = {k: [] for k in ("resident_ms", "step_ms", "cpu_ms", "d2h_us", "h2d_us")}
    pairs = trip.stats.pairs

    def host_step(masked_ids: torch.Tensor, masked_gates: torch.Tensor) -> None:
        trip.send(store, False, x, masked_ids, masked_gates)  # masks the graph's buffers in place
        run()
        trip.add(out)

    for _ in range(reps + 1):  # the first is a warm-up
        rows["resident_ms"].append(_ms(run, backend))
        masked = (ids.clone(), gates.clone())
        rows["step_ms"].append(_ms(lambda masked=masked: host_step(*masked), backend))
        rows["cpu_ms"].append(trip.host_s * 1e3)
        d2h, h2d = trip.copies.copy_ms()
        rows["d2h_us"].append(None if d2h is None else d2h * 1e3)
        rows["h2d_us"].append(None if h2d is None else h2d * 1e3)
    figures = {k: (round(statistics.median(v[1:]), 3) if v[1] is not None else None) for k, v in rows.items()}
    host_side = figures["cpu_ms"] + ((figures["d2h_us"] or 0) + (figures["h2d_us"] or 0)) / 1e3
    hidden_ms = figures["resident_ms"] + host_side - figures["step_ms"]
    figures.update(batch=x.shape[0], cold_pairs_per_step=round((trip.stats.pairs - pairs) / (reps + 1), 2),
                   bytes_to_host=x.shape[0] * (x.shape[1] * x.element_size() + top_k * (ids.element_size() + 4)),
                   overlap_fraction=round(min(1.0, max(0.0, hidden_ms / host_side)), 3) if host_side else None)
    return figures


def _capture(fns: list) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per function, warmed up on a side stream first (as torch requires), one pool."""
    side, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for fn in fns:
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1], pool=pool):
            fn()
    torch.cuda.synchronize()
    return graphs


def _ms(fn, backend: PageBackend) -> float:
    backend.synchronize()
    start = time.perf_counter()
    fn()
    backend.synchronize()
    return (time.perf_counter() - start) * 1e3
