#!/usr/bin/env python
"""Whole-region vs routed-only vs auto staging on this machine (issue 12).

The tiny model's MoE layers (128 experts, top-2, 6 layers, float32) with 25% of each eligible layer
offloaded, run through the project's own forward path: each layer goes through `run_moe_core_staged`
(the staging break with the router's top-k ids, `after_moe`) around SGLang's CPU MoE kernel
(`moe_forward_native`, what the CPU server runs), with the real StagingEngine over host pages. Per
decode batch (1, 4, 16, 64) and one prefill size, per mode: median ms per forward, staged bytes per
forward, and whether every forward's output equals the unpaged reference bit for bit. Modes run
interleaved in each repetition, in rotated order, so machine noise hits them alike; auto gets warm-up steps first (it
measures whole once per token bucket).

    OMP_NUM_THREADS=1 .venv/bin/python -m eval.bench_staging --json results/bench_staging.json [--plot F.png]

Prints a table; the JSON holds `batches -> mode -> {ms, staged_bytes, identical}`.

`--quant fp8` (issue 20) runs the same layers twice, with bf16 experts and with the same experts block-
quantised to FP8 (the FP8 stack runs SGLang's FP8 CPU call, `fused_experts_cpu`, as our CPU op answers
it), each against its own unpaged reference, and adds `fp8_vs_bf16 -> mode -> staged-bytes ratio`: FP8
stages one byte per weight where bf16 stages two, for the same offloaded experts.

    OMP_NUM_THREADS=1 .venv/bin/python -m eval.bench_staging --quant fp8 --sizes 4 --json results/bench_staging_fp8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from eval.bench_memory import Contention
from vamp_sglang.block_fp8 import BLOCK
from vamp_sglang.cpu import fp8 as cpu_fp8
from vamp_sglang.cpu.fp8 import FP8_W8A16, fused_experts
from vamp_sglang.integration.staging.moe_staging import ModelExperts, run_moe_core_staged
from vamp_sglang.memory.backend_choice import select_backend
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores
from vamp_sglang.tiny_moe.common import TinyMoeSpec
from vamp_sglang.tiny_moe.fp8 import quantise

MODES = ("whole", "routed", "auto")
DECODE_BATCHES, PREFILL_TOKENS = (1, 4, 16, 64), 512
RATIO = 0.25
_TINY = TinyMoeSpec()


class TinyMoeStack:
    """The tiny model's MoE layers (router, w13, w2) as SGLang-shaped layer objects; the first stays
    resident, the others live on ExpertStores whose top 25% is offloaded. `dtype` float32 or bfloat16
    experts, or `torch.float8_e4m3fn`: the bf16 experts block-quantised, with resident scales."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        e, h, i = _TINY.experts, _TINY.hidden, _TINY.intermediate
        self.layer_ids = list(range(_TINY.layers))
        self.fp8 = dtype == torch.float8_e4m3fn
        self.dtype = torch.bfloat16 if self.fp8 else dtype  # the activations'
        self.weights = {lid: (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5,
                              torch.randn(e, h, i, generator=gen) / i ** 0.5,
                              torch.randn(e, h, generator=gen)) for lid in self.layer_ids}
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for lid, (w13, w2, router) in self.weights.items():
            if self.fp8:
                (q13, s13), (q2, s2) = (_quantise_experts(w) for w in (w13, w2))
                self.weights[lid], self.scales[lid] = (q13, q2, router.to(self.dtype)), (s13, s2)
            else:
                self.weights[lid] = (w13.to(dtype), w2.to(dtype), router.to(dtype))
        self.backend = select_backend("host", "cpu")
        w13, w2, _ = self.weights[0]
        self.layout = ExpertLayout.compute(self.layer_ids, e, w13[0].numel() * w13.element_size(),
                                           w2[0].numel() * w2.element_size(), self.backend.granularity_bytes,
                                           RATIO, e)
        self.buffers, self.stores = build_expert_stores(
            self.backend, self.layout, {lid: w[:2] for lid, w in self.weights.items() if lid in
                                        self.layout.eligible_layer_ids})
        for store in self.stores:
            for handle in store.offload_tail_pages(self.layout.bound_groups):
                self.backend.release(handle)
        paged = {s.layer_id: (s.w13, s.w2) for s in self.stores}
        self.paged = {lid: _layer(lid, *paged.get(lid, self.weights[lid][:2]), *self.scales.get(lid, ()))
                      for lid in self.layer_ids}
        self.reference = {lid: _layer(lid, *self.weights[lid][:2], *self.scales.get(lid, ()))
                          for lid in self.layer_ids}

    def experts_with(self, policy: str) -> ModelExperts:
        engine = StagingEngine(self.stores, "async", staging=policy, top_k=_TINY.top_k)
        return ModelExperts(self.backend, self.layout, self.buffers, self.stores, engine,
                            {s.layer_id: self.paged[s.layer_id] for s in self.stores})

    def forward(self, x: torch.Tensor, experts: ModelExperts | None) -> torch.Tensor:
        """Residual stack of routed MoE layers, each through run_moe_core_staged (or plain, unpaged)."""
        from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        config = SimpleNamespace(activation="silu", apply_router_weight_on_input=False, gemm1_alpha=None,
                                 gemm1_clamp_limit=None)

        def kernel(layer, dispatch_output):
            if self.fp8:  # what Fp8MoEMethod.apply calls on CPU (quantization/fp8.py:3117), our op answering
                weights, ids, _ = dispatch_output.topk_output
                return fused_experts(dispatch_output.hidden_states, layer.w13_weight, layer.w2_weight, weights,
                                     ids, False, FP8_W8A16, layer.w13_weight_scale_inv, layer.w2_weight_scale_inv,
                                     None, None, [BLOCK, BLOCK], None, None, None, None, True, "silu")
            return moe_forward_native(layer, dispatch_output.hidden_states, dispatch_output.topk_output, config)

        if experts is not None:
            experts.engine.begin_forward(x.shape[0])
        for lid in self.layer_ids:
            logits = (x @ self.weights[lid][2].T).float()
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), _TINY.top_k, dim=-1)
            topk = StandardTopKOutput(weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32), logits)
            dispatch = StandardDispatchOutput(x, None, topk)
            if experts is None:
                out = kernel(self.reference[lid], dispatch)
            else:
                out = run_moe_core_staged(experts, kernel, self.paged[lid], dispatch)
            x = x + out
        return x

    def close(self, *experts: ModelExperts) -> None:
        for item in experts:
            item.engine.close()
        experts[0].close() if experts else None
        self.backend.close()


def _layer(layer_id: int, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor | None = None,
           s2: torch.Tensor | None = None) -> SimpleNamespace:
    """What moe_forward_native (or the FP8 op) and run_moe_core_staged read of a FusedMoE."""
    return SimpleNamespace(layer_id=layer_id, w13_weight=w13, w2_weight=w2, num_experts=w13.shape[0],
                           w13_weight_scale_inv=s13, w2_weight_scale_inv=s2)


def _quantise_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] bf16-rounded weights -> (FP8 [E, N, K], scales [E, N/128, K/128])."""
    pairs = [quantise(w.to(torch.bfloat16).float()) for w in weight]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def bench(sizes: list[int], reps: int, warmup: int, dtype: torch.dtype = torch.float32) -> dict:
    stack = TinyMoeStack(dtype=dtype)
    experts = {mode: stack.experts_with(mode) for mode in MODES}
    result: dict = {"model": "tiny-qwen3-moe layers", "experts_dtype": str(dtype).removeprefix("torch."),
                    "offload_ratio": RATIO, "reps": reps, "batches": {}}
    progress = tqdm(total=len(sizes) * (warmup + reps), desc="bench_staging", unit="rep")
    for tokens in sizes:
        inputs = [torch.randn(tokens, _TINY.hidden, generator=torch.Generator().manual_seed(tokens * 1000 + r)
                              ).to(stack.dtype) for r in range(warmup + reps)]
        times = {m: [] for m in MODES}
        staged = {m: [] for m in MODES}
        identical = dict.fromkeys(MODES, True)
        with Contention() as load:
            for rep, x in enumerate(inputs):
                reference = stack.forward(x, None)
                for mode in MODES[rep % 3:] + MODES[:rep % 3]:  # rotated: no mode always runs first
                    before = experts[mode].engine.stats().bytes_staged
                    start = time.perf_counter()
                    out = stack.forward(x, experts[mode])
                    elapsed = time.perf_counter() - start
                    identical[mode] &= torch.equal(out, reference)
                    if rep >= warmup:
                        times[mode].append(elapsed)
                        staged[mode].append(experts[mode].engine.stats().bytes_staged - before)
                progress.update()
        result["batches"][str(tokens)] = {
            m: {"ms": statistics.median(times[m]) * 1e3, "staged_bytes": statistics.mean(staged[m]),
                "identical": identical[m],
                "routed_steps": experts[m].engine.stats().by_mode["routed"]["steps"]} for m in MODES}
        result["batches"][str(tokens)]["other_cores_busy"] = load.other_cores
    progress.close()
    stack.close(*experts.values())
    return result


def table(result: dict) -> str:
    lines = [f"{'tokens':>7}  " + "  ".join(f"{m + ' ms':>10} {m + ' MiB':>11} {'same':>4}" for m in MODES)
             + "  auto/whole ms  auto/whole bytes"]
    for tokens, row in result["batches"].items():
        cells = "  ".join(f"{row[m]['ms']:10.2f} {row[m]['staged_bytes'] / 2 ** 20:11.2f} "
                          f"{'yes' if row[m]['identical'] else 'NO':>4}" for m in MODES)
        whole, auto = row["whole"], row["auto"]
        lines.append(f"{tokens:>7}  {cells}  {auto['ms'] / whole['ms']:13.3f}  "
                     f"{auto['staged_bytes'] / max(whole['staged_bytes'], 1):16.3f}")
    return "\n".join(lines)


def fp8_ratios(bf16: dict, fp8: dict) -> dict:
    """Per batch and mode: FP8's staged bytes and time over bf16's, and whether both were exact."""
    return {tokens: {m: {"staged_bytes": fp8["batches"][tokens][m]["staged_bytes"] / max(row[m]["staged_bytes"], 1),
                         "ms": fp8["batches"][tokens][m]["ms"] / row[m]["ms"],
                         "identical": row[m]["identical"] and fp8["batches"][tokens][m]["identical"]}
                     for m in MODES} for tokens, row in bf16["batches"].items()}


def fp8_table(ratios: dict) -> str:
    lines = [f"{'tokens':>7}  " + "  ".join(f"{m + ' bytes fp8/bf16':>22} {'same':>4}" for m in MODES)]
    for tokens, row in ratios.items():
        lines.append(f"{tokens:>7}  " + "  ".join(f"{row[m]['staged_bytes']:22.3f} "
                                                  f"{'yes' if row[m]['identical'] else 'NO':>4}" for m in MODES))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["batches"])
    fig, (ax_ms, ax_bytes) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in MODES:
        ax_ms.plot(sizes, [result["batches"][s][mode]["ms"] for s in sizes], marker="o", label=mode)
        ax_bytes.plot(sizes, [result["batches"][s][mode]["staged_bytes"] / 2 ** 20 for s in sizes], marker="o",
                      label=mode)
    ax_ms.set(xlabel="tokens per forward", ylabel="ms per forward", title="forward time")
    ax_bytes.set(xlabel="tokens per forward", ylabel="MiB staged per forward", title="staged bytes")
    for ax in (ax_ms, ax_bytes):
        ax.legend()
    fig.suptitle(f"tiny MoE, {RATIO:.0%} offloaded: whole vs routed vs auto staging")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a plot here (default: next to --json, .png)")
    parser.add_argument("--reps", type=int, default=15, help="timed forwards per size and mode (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed forwards first (auto measures whole)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[*DECODE_BATCHES, PREFILL_TOKENS])
    parser.add_argument("--quant", choices=["fp8"], help="fp8: bf16 experts against the same experts in block FP8")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the server runs (OMP_NUM_THREADS=1): the staging worker gets the other core
    if args.quant == "fp8":
        cpu_fp8.register_ops()
        runs = {name: bench(args.sizes, args.reps, args.warmup, dtype)
                for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn))}
        result = runs | {"fp8_vs_bf16": fp8_ratios(runs["bf16"], runs["fp8"])}
        for name in ("bf16", "fp8"):
            print(f"{name} experts\n{table(runs[name])}")
        print(fp8_table(result["fp8_vs_bf16"]))
    else:
        result = bench(args.sizes, args.reps, args.warmup)
        print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    plot_path = args.plot or (args.json.with_suffix(".png") if args.json else None)
    if plot_path:
        plot(result["fp8"] if args.quant else result, plot_path)


if __name__ == "__main__":
    main()
