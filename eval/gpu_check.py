#!/usr/bin/env python
"""The one GPU check (issue 10): the project's own page backend, expert stores, KV buffers, repartitioner
and staging engine on CUDA, in one call of under 5 minutes. Needs torch and cuda-bindings only: no
SGLang, no pyzmq (the report lists any such module that got imported, and fails if one did).

    python eval/gpu_check.py --require-gpu --json OUT.json  # a GPU machine; exit 2 without a usable GPU,
                                                           # exit 1 if any section fails
    python eval/gpu_check.py --dry-run                     # list the sections
    python eval/gpu_check.py --json OUT.json               # no GPU: the sections that run on host pages,
                                                           # at toy sizes (a smoke test of this script)

Sections, in run order, each a module of eval/gpu_sections/ (its docstring says what it checks), each
reported separately, each on a backend of its own; one failing does not stop the others, and what a
section leaves behind (pages mapped, a CUDA error pending) fails that section, not the next:
  backend              backend_pages: expert pages to a KV region and back, KV tensor grown in place.
  driver               driver_rules: what the driver itself enforces, bypassing our bookkeeping (GPU only).
  remap                remap_rate: create / map / unmap / remap / release of 1 GiB of pages, ms per GiB.
  graphs               graph_segments: captured segments with eager staging breaks over offloaded experts,
                       bit for bit against runs of the same kernels; restore; no page leaked.
  overlap              staging_overlap: staging hidden behind Qwen3-Next-sized MoE compute at batch 1/16/64.
  routed               routed_staging: routed-only staging, the device copy list in a CUDA graph (issue 12).
  routing_order        routing_order_graph: residency by routing's id map inside a captured CUDA graph, replayed
                       after a reorder and its rollback (issue 49).
  host_experts         host_experts_graph: --vamp-staging host's round trip between captured segments; D2H, CPU,
                       H2D, resident times and their overlap at batch 1/16/64 (issue 49).
  state                state_growth: layer-strided linear-attention state tensors grown and shrunk in place.
  prefill_stream       prefill_stream_timing: PrefillTimer on the forward's stream (GPU only).
  side_stream_capture  side_stream_capture: breakable capture over MoE blocks that fork to a side stream
                       (GPU only; issue 19 item 1).
  resize_rollback      resize_rollback: KV and state offloads whose publish fails, rolled back exactly.
  state_pool_alloc     state_pool_alloc: state pool over growable pages on a nearly full device.
  compaction_probe     compaction_probe: one restore attempt's compaction probe over 50,000 small device index
                       tensors, batched against the per-node loop it replaced (issue 48, defect 5).
  hicache_budget       hicache_budget: the HiCache host budget after cudaHostRegister of 60% of MemAvailable
                       (GPU only; defect 4).
  grown_attention      grown_attention: attention over a grown MLA latent buffer inside a captured CUDA graph:
                       fp8 -> bf16 conversion, Triton gather, flash_mla and FA3 where importable (GPU only;
                       defects 1, 2, 7).
  sglang_fp8_moe       sglang_fp8_moe: SGLang's block-FP8 Triton fused MoE with the split-w2 break over paged
                       FP8 experts, and SGLang's routed gather with FP8 host rows (GPU only; needs SGLang,
                       runs after the no-SGLang import check, skipped without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from eval.gpu_sections import (
    backend_pages,
    compaction_probe,
    driver_rules,
    graph_segments,
    grown_attention,
    hicache_budget,
    host_experts_graph,
    prefill_stream_timing,
    remap_rate,
    resize_rollback,
    routed_staging,
    routing_order_graph,
    sglang_fp8_moe,
    side_stream_capture,
    staging_overlap,
    state_growth,
    state_pool_alloc,
)
from vamp_sglang.memory.backend import BackendUnavailableError, LiveCounts, PageBackend
from vamp_sglang.memory.backend_choice import select_backend

HOST_GRAN = 64 << 10  # host runs: small pages keep the smoke test fast
FORBIDDEN_IMPORTS = ("sglang", "zmq")

SECTIONS: dict[str, tuple[bool, Callable[[PageBackend, bool], dict]]] = {  # name -> (GPU only, check)
    "backend": (False, backend_pages.check),
    "driver": (True, driver_rules.check),
    "remap": (False, remap_rate.check),
    "graphs": (False, graph_segments.check),
    "overlap": (False, staging_overlap.check),
    "routed": (False, routed_staging.check),
    "routing_order": (False, routing_order_graph.check),
    "host_experts": (False, host_experts_graph.check),
    "state": (False, state_growth.check),
    "prefill_stream": (True, prefill_stream_timing.check),
    "side_stream_capture": (True, side_stream_capture.check),
    "resize_rollback": (False, resize_rollback.check),
    "state_pool_alloc": (False, state_pool_alloc.check),
    "compaction_probe": (False, compaction_probe.check),
    "hicache_budget": (True, hicache_budget.check),
    "grown_attention": (True, grown_attention.check),
    "sglang_fp8_moe": (True, sglang_fp8_moe.check),
}
NEEDS_SGLANG = ("sglang_fp8_moe",)  # run after the no-SGLang import check, skipped where SGLang is missing


def run_section(report: dict, name: str, check: Callable[[PageBackend, bool], dict],
                make_backend: Callable[[], PageBackend], gpu: bool) -> None:
    """One section on a backend of its own. Whatever it leaves behind fails it and is freed here, so it
    cannot fail the sections after it (the first H200 run: one section that raised left pages mapped and
    a host range registered, and four sections after it failed on those): pages still mapped or live,
    host arenas it dropped (collected, so unregistered), a CUDA error left pending."""
    start = time.perf_counter()
    backend = None
    try:
        backend = make_backend()
        report[name] = check(backend, gpu)
    except Exception:  # noqa: BLE001 - one broken section must not hide the others' results
        report[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    gc.collect()
    pending = _pending_cuda_error() if gpu else None
    if pending:
        report[name].update(ok=False, left_cuda_error=pending)
    if backend is not None:
        left = backend.live_counts()
        if left != LiveCounts(0, 0, 0):
            report[name].update(ok=False, left_live=dataclasses.asdict(left))
        try:
            backend.close()
        except Exception:  # noqa: BLE001 - a section that broke the device: the next ones will say so too
            report[name].update(ok=False, close_error=traceback.format_exc()[-1500:])
    report[name]["seconds"] = round(time.perf_counter() - start, 2)


def _forbidden_imports() -> list[str]:
    return sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN_IMPORTS))


def _pending_cuda_error() -> str | None:
    """An error the section's kernels raised asynchronously, or a runtime error nobody read: torch reads the
    runtime's last error after each launch (cudaGetLastError, which also clears it), so one tiny launch and
    a synchronize report it here instead of in the next section. torch's own runtime: cuda-bindings' runtime
    module may be a separate copy of cudart, with a last error of its own."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError as exc:  # torch.AcceleratorError is one
        return str(exc).splitlines()[0]
    return None


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
        width = max(map(len, SECTIONS))
        for name, (gpu_only, fn) in SECTIONS.items():
            doc = (fn.__doc__ or "").strip().split("\n")[0]
            print(f"{name:{width}s}  {'GPU only' if gpu_only else 'GPU (host pages without one)':28s}  {doc}")
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
    backend.close()

    def make_backend() -> PageBackend:
        if gpu:
            return select_backend("cuda", torch.device("cuda", 0))
        return select_backend("host", "cpu", granularity_bytes=HOST_GRAN)

    for name, (gpu_only, check) in sorted(SECTIONS.items(), key=lambda item: item[0] in NEEDS_SGLANG):
        if name in NEEDS_SGLANG and "forbidden_imports" not in report:
            report["forbidden_imports"] = _forbidden_imports()
        if gpu_only and not gpu:
            report[name] = {"skipped": "needs a GPU"}
            continue
        run_section(report, name, check, make_backend, gpu)
    report.setdefault("forbidden_imports", _forbidden_imports())
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
