"""Per-core throughput of one MoE expert's matmuls on this machine's CPU (issue 49, the host side).

Why: `--vamp-staging host` (issue 49) would compute the tokens routed to offloaded experts on the host, from
the pinned host copies, instead of copying the experts' weights over PCIe. Whether that pays depends on
how fast a CPU core runs one expert's SwiGLU MLP (x @ w13^T, silu(gate) * up, @ w2^T) for the handful of
tokens a decode step sends it. This measures that, per core (`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`),
for 1-64 tokens per expert, in bfloat16 and float32, at one expert's shape (hidden 2048, intermediate 512:
Qwen3-Next's and Qwen3.6-35B-A3B's expert). The weights cycle over enough experts to exceed the last-level
cache, so each call reads its weights from DRAM, as a cold expert's host copy would be read.

The machine is shared with other jobs: each point is the median over `--repeats` timed rounds (each round
times `--calls` calls), and the spread (min, max) is kept in the JSON. eval/bench_decode_cost.py scales the
per-core rate to a named server CPU's core count and caps it by that CPU's published memory bandwidth.

    OMP_NUM_THREADS=1 .venv/bin/python -m eval.bench_host_experts --json results/decode_cost/host_experts.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

TOKENS = (1, 2, 4, 8, 16, 32, 64)


def cpu_name() -> str:
    """The CPU model string and whether it has AMX / AVX-512 BF16 (what a bf16 matmul can use)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return f"{name} (amx_bf16: {'amx_bf16' in flags}, avx512_bf16: {'avx512_bf16' in flags})"


def expert_flops(tokens: int, hidden: int, inter: int) -> int:
    """Multiply-adds x2 of gate+up ([T,H] x [H,2I]) and down ([T,I] x [I,H])."""
    return 2 * tokens * hidden * 3 * inter


def time_expert(tokens: int, hidden: int, inter: int, dtype: torch.dtype, experts: int, calls: int,
                repeats: int) -> list[float]:
    """Seconds per expert call, one value per timed round."""
    gen = torch.Generator().manual_seed(tokens)
    w13 = [torch.randn(2 * inter, hidden, generator=gen).to(dtype) for _ in range(experts)]
    w2 = [torch.randn(hidden, inter, generator=gen).to(dtype) for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)

    def call(e: int) -> torch.Tensor:
        gate_up = x @ w13[e].T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        return act @ w2[e].T

    for e in range(experts):  # warm-up: first-touch pages, oneDNN kernel selection
        call(e)
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for c in range(calls):
            call(c % experts)
        rounds.append((time.perf_counter() - start) / calls)
    return rounds


def measure(hidden: int, inter: int, repeats: int, calls: int, llc_bytes: int) -> dict:
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "hidden": hidden, "intermediate": inter,
              "repeats": repeats, "calls_per_repeat": calls, "load_average_1min_before": os.getloadavg()[0],
              "dtypes": {}}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        expert_bytes = 3 * hidden * inter * dtype.itemsize
        experts = max(2, -(-2 * llc_bytes // expert_bytes))  # twice the last-level cache: weights come from DRAM
        rows = []
        for tokens in TOKENS:
            rounds = time_expert(tokens, hidden, inter, dtype, experts, calls, repeats)
            median = statistics.median(rounds)
            rows.append({"tokens": tokens, "median_ms": round(median * 1e3, 4),
                         "min_ms": round(min(rounds) * 1e3, 4), "max_ms": round(max(rounds) * 1e3, 4),
                         "gflops_per_core": round(expert_flops(tokens, hidden, inter) / median / 1e9, 2),
                         "weight_gb_per_s_per_core": round(expert_bytes / median / 1e9, 2)})
            print(f"{name:>8} tokens {tokens:>3}: {median * 1e3:8.3f} ms per expert call, "
                  f"{rows[-1]['gflops_per_core']:7.2f} GFLOP/s, {rows[-1]['weight_gb_per_s_per_core']:6.2f} GB/s "
                  f"of weights (per core)", flush=True)
        result["dtypes"][name] = {"expert_bytes": expert_bytes, "experts_cycled": experts, "points": rows}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_host_experts", description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the measurements")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per point; the median is kept")
    parser.add_argument("--calls", type=int, default=24, help="expert calls per timed round")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--llc-mib", type=int, default=32, help="last-level cache to exceed (MiB; default 32)")
    args = parser.parse_args(argv)
    for flag, value in (("--repeats", args.repeats), ("--calls", args.calls), ("--hidden", args.hidden),
                        ("--intermediate", args.intermediate), ("--llc-mib", args.llc_mib)):
        if value < 1:
            parser.error(f"{flag} must be a positive integer (got {value})")
    if os.environ.get("OMP_NUM_THREADS") != "1":
        parser.error("run with OMP_NUM_THREADS=1: this measures one core's throughput")
    torch.set_num_threads(1)
    result = measure(args.hidden, args.intermediate, args.repeats, args.calls, args.llc_mib << 20)
    result["load_average_1min_after"] = os.getloadavg()[0]  # other jobs on the machine slow every point
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
