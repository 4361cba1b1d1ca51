#!/usr/bin/env python
"""One prepared GPU check for the CUDA page backend and expert staging (issue 4). Plain torch + cuda-python.

Sections (each reported separately; one failing does not stop the others):
  backend   reserve/create/map/unmap on the CUDA backend: pages move from an "expert" region to a "KV" region
            and back, the KV tensor object grows in place, every checksum survives, nothing leaks.
  driver    what the driver itself enforces (bypassing our bookkeeping): sub-range unmap, one unmap over two
            adjacent mappings, map over mapped VA. Tells whether the host backend's rules match the driver.
  remap     unmap + map time per GiB of 2 MiB pages (and create, release), data checked after the move.
  staging   a Qwen3-Next MoE layer at TP2 (512 experts, hidden 2048, moe_intermediate 512, bf16): gather the
            offloaded 25% (128 experts) from pinned host memory on a copy stream while the compute stream
            runs the layer's grouped matmuls; copy alone, compute alone, concurrent, overlap %.

Prints JSON to stdout and writes it to $OUT/gpu_check.json when OUT is set. Exit 1 if a check failed.
Without a CUDA device (or with --dry-run) the GPU sections say "no CUDA device: skipped", the backend and
remap sections run on the host backend at small sizes, the staging layer runs once on CPU at toy size to
check shapes, and the exit code is 0 when those pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from vamp_sglang.memory.backend import BackendUnavailableError, PageBackend, select_backend
from vamp_sglang.memory.region import PagedRegion

MIB, GIB = 1 << 20, 1 << 30
SKIPPED = "no CUDA device: skipped"
KV_ROW_SHAPE = (8, 128)  # [kv heads, head dim] bf16: 2 KiB per token


def check_backend(backend: PageBackend) -> dict:
    """Expert pages -> KV tail -> back, with checksums and an in-place grown KV tensor."""
    g = backend.granularity_bytes
    experts, kv = PagedRegion(backend, 16 * g), PagedRegion(backend, 24 * g)
    experts.extend([backend.create(g) for _ in range(16)])
    kv.extend([backend.create(g) for _ in range(8)])
    gen = torch.Generator(device=backend.device).manual_seed(0)
    expert_bytes = experts.view(torch.uint8, (16 * g,))
    expert_bytes.copy_(torch.randint(0, 256, (16 * g,), dtype=torch.uint8, device=backend.device, generator=gen))
    tokens_per_page = g // (2 * KV_ROW_SHAPE[0] * KV_ROW_SHAPE[1])
    k_buffer = kv.view(torch.bfloat16, (8 * tokens_per_page, *KV_ROW_SHAPE))
    k_buffer.fill_(3.0)
    holders, ptr = [k_buffer], k_buffer.data_ptr()
    expert_sums, kv_sums = experts.page_checksums(), kv.page_checksums()
    host_copy = backend.host_buffer(8 * g)
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
    counts = backend.live_counts()
    result["nothing_left_mapped_or_live"] = counts.mappings == counts.reservations == counts.handles == 0
    result["ok"] = all(result.values())
    return result


def probe_driver_rules(backend: PageBackend) -> dict:
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
    return result


def _attempt(call, undo) -> str:
    """'refused: <error>' when the driver rejects the call (then `undo` cleans up), else 'accepted'."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - recording the driver's answer is the point
        undo()
        return f"refused: {exc}"
    return "accepted"


def measure_remap(backend: PageBackend, nbytes: int, reps: int) -> dict:
    """Create, map, unmap, remap elsewhere and release `nbytes` of pages; times per GiB, data checked."""
    g = backend.granularity_bytes
    n_pages = nbytes // g
    per_gib = GIB / (n_pages * g)
    rows: dict[str, list[float]] = {k: [] for k in ("create", "map", "unmap", "remap_map", "regrow", "release")}
    data_ok = True
    for rep in range(reps):
        src, dst = PagedRegion(backend, n_pages * g), PagedRegion(backend, n_pages * g)
        t = _timer(backend)
        handles = [backend.create(g) for _ in range(n_pages)]
        rows["create"].append(t())
        src.extend(handles)
        rows["map"].append(t())
        src.view(torch.uint8, (n_pages * g,)).fill_(rep + 1)
        view = dst.view(torch.uint8, (0,))
        backend.synchronize()
        t = _timer(backend)
        moved = [src.pop_tail() for _ in range(n_pages)]
        rows["unmap"].append(t())
        dst.extend(moved[::-1])
        rows["remap_map"].append(t())
        dst.regrow(view, (n_pages * g,))
        rows["regrow"].append(t())
        data_ok &= bool((view == rep + 1).all())
        src.close()
        dst.close()
        t = _timer(backend)
        for h in handles:
            backend.release(h)
        rows["release"].append(t())
    result = {f"{k}_ms_per_gib": round(statistics.median(v) * 1e3 * per_gib, 3) for k, v in rows.items()}
    result["remap_ms_per_gib"] = round(result["unmap_ms_per_gib"] + result["remap_map_ms_per_gib"], 3)
    result.update(pages=n_pages, page_bytes=g, reps=reps, data_survived_remap=data_ok)
    return result


def _timer(backend: PageBackend):
    """Returns a callable giving seconds since the last call, after synchronizing the device."""
    last = [time.perf_counter()]

    def lap() -> float:
        backend.synchronize()
        now = time.perf_counter()
        elapsed, last[0] = now - last[0], now
        return elapsed

    return lap


def moe_layer(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Grouped expert MLP: x [E, T, H], w13 [E, 2I, H], w2 [E, H, I] -> [E, T, H] (SiLU-gated)."""
    gate_up = torch.bmm(x, w13.transpose(1, 2))  # [E, T, 2I]
    inter = gate_up.shape[-1] // 2
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]  # [E, T, I]
    return torch.bmm(act, w2.transpose(1, 2))  # [E, T, H]


def measure_staging(device: torch.device, experts: int, hidden: int, moe_inter: int, tp: int,
                    offload_ratio: float, batch_tokens: list[int], top_k: int, reps: int) -> dict:
    """Copy the offloaded experts host->device on a copy stream while the compute stream runs the layer."""
    inter = moe_inter // tp
    off = int(experts * offload_ratio)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device) * 0.02
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device=device) * 0.02
    host_w13 = torch.empty((off, 2 * inter, hidden), dtype=torch.bfloat16, pin_memory=True)
    host_w2 = torch.empty((off, hidden, inter), dtype=torch.bfloat16, pin_memory=True)
    host_w13.copy_(w13[experts - off:])
    host_w2.copy_(w2[experts - off:])
    stage_w13, stage_w2 = torch.empty_like(w13[:off]), torch.empty_like(w2[:off])
    copy_stream, compute_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def copy() -> None:
        stage_w13.copy_(host_w13, non_blocking=True)
        stage_w2.copy_(host_w2, non_blocking=True)

    staged_bytes = (host_w13.numel() + host_w2.numel()) * 2
    copy_ms = _median_ms(lambda: _on(copy_stream, copy), reps)
    exact = torch.equal(stage_w13, w13[experts - off:]) and torch.equal(stage_w2, w2[experts - off:])
    result = {"experts": experts, "offloaded_experts": off, "staged_bytes": staged_bytes,
              "copy_ms": round(copy_ms, 3), "copy_gb_per_s": round(staged_bytes / copy_ms / 1e6, 1),
              "staged_bytes_exact": exact, "batches": []}
    for tokens in batch_tokens:
        result["batches"].append(_overlap_at(tokens, experts, hidden, top_k, w13, w2, copy, copy_ms,
                                             copy_stream, compute_stream, reps))
    return result


def _overlap_at(tokens: int, experts: int, hidden: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor, copy,
                copy_ms: float, copy_stream: torch.cuda.Stream, compute_stream: torch.cuda.Stream,
                reps: int) -> dict:
    """One batch size: the layer alone, enough layers to match one copy, and both streams at once."""
    per_expert = max(1, tokens * top_k // experts)
    x = torch.randn(experts, per_expert, hidden, dtype=w13.dtype, device=w13.device)  # [E, T, H]
    layer_ms = _median_ms(lambda: _on(compute_stream, lambda: moe_layer(x, w13, w2)), reps)
    layers = max(1, round(copy_ms / layer_ms))  # enough layers of compute to be comparable to one copy

    def compute() -> None:
        for _ in range(layers):
            moe_layer(x, w13, w2)

    compute_ms = _median_ms(lambda: _on(compute_stream, compute), reps)
    both_ms = _median_ms(lambda: (_on(copy_stream, copy, sync=False), _on(compute_stream, compute)), reps)
    hidden_ms = copy_ms + compute_ms - both_ms
    return {"batch_tokens": tokens, "tokens_per_expert": per_expert, "layer_ms": round(layer_ms, 3),
            "copy_over_layer": round(copy_ms / layer_ms, 2), "compute_layers": layers,
            "compute_ms": round(compute_ms, 3), "concurrent_ms": round(both_ms, 3),
            "serial_ms": round(copy_ms + compute_ms, 3),
            "overlap_pct": round(100.0 * hidden_ms / min(copy_ms, compute_ms), 1)}


def _on(stream: torch.cuda.Stream, fn, sync: bool = True) -> None:
    with torch.cuda.stream(stream):
        fn()
    if sync:
        torch.cuda.synchronize(stream.device)


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up (kernel selection, first touch)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_section(report: dict, name: str, fn) -> None:
    start = time.perf_counter()
    try:
        report[name] = fn()
    except Exception:  # noqa: BLE001 - one broken section must not hide the others' results
        report[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    report[name]["seconds"] = round(time.perf_counter() - start, 2)


def cuda_backend_or_reason(dry_run: bool) -> tuple[PageBackend | None, str]:
    if dry_run:
        return None, "--dry-run"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    try:
        return select_backend("cuda", torch.device("cuda", 0)), ""
    except BackendUnavailableError as exc:
        return None, str(exc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="skip the GPU even if one is present")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    report: dict = {"torch": torch.__version__}
    backend, reason = cuda_backend_or_reason(args.dry_run)
    if backend is None:
        report["status"] = f"{SKIPPED} ({reason})"
        for name in ("driver", "staging"):
            report[name] = {"status": SKIPPED}
        host = select_backend("host", "cpu")
        run_section(report, "backend", lambda: check_backend(host))
        run_section(report, "remap", lambda: measure_remap(host, 64 * MIB, reps=1))
        run_section(report, "staging_shapes_cpu", lambda: {"ok": tuple(moe_layer(
            torch.randn(8, 3, 64), torch.randn(8, 32, 64), torch.randn(8, 64, 16)).shape) == (8, 3, 64)})
        host.close()

    else:
        torch.cuda.init()
        report.update(status="ran on GPU", gpu=torch.cuda.get_device_name(0),
                      granularity_bytes=backend.granularity_bytes)
        run_section(report, "backend", lambda: check_backend(backend))
        run_section(report, "remap", lambda: measure_remap(backend, GIB, reps=3))
        run_section(report, "driver", lambda: probe_driver_rules(backend))  # last user of the backend
        run_section(report, "staging", lambda: measure_staging(
            torch.device("cuda", 0), experts=512, hidden=2048, moe_inter=512, tp=2, offload_ratio=0.25,
            batch_tokens=[256, 8192], top_k=10, reps=args.reps))
        backend.close()
    failed = [name for name, section in report.items() if isinstance(section, dict) and False in (
        section.get("ok"), section.get("data_survived_remap"), section.get("staged_bytes_exact"))]
    report["failed_sections"] = failed
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
