#!/usr/bin/env python
"""Memory-mechanism figures on this machine (issue 4): remap cost, KV tokens per expert group, staging overlap.

  remap     the tiny model's eligible layers over host pages (2 MiB): offload (unmap expert pages, alias
            the staging slot, map at the KV tails, regrow) and restore (the reverse plus the copy back
            from the host copy), in ms per GiB moved.
  kv_gain   per offloaded group (paper V-A): group size g, pages, bytes freed over all eligible layers and
            KV tokens gained, for the tiny model and Qwen3-30B-A3B / Qwen3-Next-80B-A3B at TP 1/2/4,
            computed from config dicts (no weights). `tokens_4_groups` is exact (pages split evenly over
            every K/V buffer, whole rows); `bound_groups` is VAMP-15 with an unconstrained staging buffer.
  staging   a forward over the tiny model's MoE layers (plain-torch per-expert loop, like SGLang's
            moe_forward_native) with 0% and 25% offloaded, staging synchronously before each layer or
            one layer ahead on a worker thread; `hidden` = share of the staging cost the thread hides,
            `prefetch_wait_ms` = time the compute thread still blocked on a copy per forward.
            Every timed section reports `other_cores_busy`: the box is shared.

    OMP_NUM_THREADS=1 .venv/bin/python eval/bench_memory.py [--quick] [--out FILE]

Prints readable tables, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from typing import Self

import torch
import torch.nn.functional as F

from vamp_sglang.memory.backend_choice import select_backend
from vamp_sglang.memory.geometry import geometry_from_config
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers
from vamp_sglang.memory.layout import ExpertLayout, kv_pages_per_buffer, kv_rows_for_bytes
from vamp_sglang.memory.repartition import Repartitioner
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores
from vamp_sglang.tiny_moe.common import TinyMoeSpec

MIB, GIB = 1 << 20, 1 << 30
PAGE_BYTES = 2 * MIB
_TINY = TinyMoeSpec()
CONFIGS = {
    "tiny": {"num_hidden_layers": _TINY.layers, "hidden_size": _TINY.hidden, "num_experts": _TINY.experts,
             "moe_intermediate_size": _TINY.intermediate, "num_key_value_heads": _TINY.kv_heads,
             "head_dim": _TINY.head_dim, "num_attention_heads": _TINY.heads, "dtype": "float32"},
    "Qwen3-30B-A3B": {"num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 128,
                      "moe_intermediate_size": 768, "num_key_value_heads": 4, "head_dim": 128,
                      "num_attention_heads": 32, "dtype": "bfloat16"},
    "Qwen3-Next-80B-A3B": {"num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 512,
                           "moe_intermediate_size": 512, "num_key_value_heads": 2, "head_dim": 256,
                           "num_attention_heads": 16, "full_attention_interval": 4, "dtype": "bfloat16"},
}


def kv_gain(name: str, tp: int, ratio: float = 0.15, expand_groups: int = 4) -> dict:
    config = CONFIGS[name]
    geo = geometry_from_config(config, tp, config["dtype"])
    lay = ExpertLayout.compute(geo.moe_layer_ids, geo.local_experts, geo.w13_shard_bytes, geo.w2_shard_bytes,
                               PAGE_BYTES, ratio, geo.local_experts)
    buffers = 2 * len(geo.kv_layer_ids)

    def exact_tokens(groups: int) -> int:
        pages = kv_pages_per_buffer(groups, lay.pages_freed_per_group, buffers)
        return kv_rows_for_bytes(pages * PAGE_BYTES, geo.kv_row_bytes)

    return {"model": name, "tp": tp, "group_experts": lay.group_experts, "shard_mib": round(
        (geo.w13_shard_bytes + geo.w2_shard_bytes) / MIB, 3), "pages_per_group_per_layer": lay.pages_per_group_per_layer,
        "eligible_layers": len(lay.eligible_layer_ids), "freed_mib_per_group": lay.bytes_freed_per_group / MIB,
        "kv_bytes_per_token": geo.kv_bytes_per_token, "tokens_per_group": lay.kv_tokens_per_group(geo.kv_bytes_per_token),
        "tokens_4_groups": exact_tokens(expand_groups), "bound_groups": lay.bound_groups,
        "tokens_at_bound": exact_tokens(lay.bound_groups)}


def tiny_system(ratio: float, kv_tokens: int, populate: bool = True):
    """The tiny model's MoE layers over host pages: (backend, weights, layout, staging, stores, kv)."""
    backend = select_backend("host", "cpu", granularity_bytes=PAGE_BYTES, populate=populate)
    geo = geometry_from_config(CONFIGS["tiny"], 1, "float32")
    gen = torch.Generator().manual_seed(0)
    e, h, i = geo.local_experts, geo.hidden_size, geo.moe_intermediate_per_rank
    weights = {lid: (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5, torch.randn(e, h, i, generator=gen) / i ** 0.5,
                     torch.randn(e, h, generator=gen)) for lid in geo.moe_layer_ids}
    lay = ExpertLayout.compute(geo.moe_layer_ids, e, geo.w13_shard_bytes, geo.w2_shard_bytes, PAGE_BYTES, ratio, e)
    staging, stores = build_expert_stores(backend, lay, {k: v[:2] for k, v in weights.items() if k in
                                                         lay.eligible_layer_ids})
    kv = GrowableKVBuffers.for_layout(backend, lay, len(geo.kv_layer_ids), geo.kv_heads_per_rank, geo.head_dim,
                                      torch.float32, kv_tokens)
    return backend, weights, lay, staging, stores, kv


def close_system(backend, staging, stores, kv, *others) -> None:
    for other in others:
        other.close()
    kv.close()
    for store in stores:
        store.close()
    staging.close()
    backend.close()


def bench_remap(reps: int, populate: bool, quiet: tuple[float, float]) -> dict:
    backend, _weights, lay, staging, stores, kv = tiny_system(0.5, 8192, populate)
    rp = Repartitioner(lay, stores, kv, lambda old, new, pool_tokens: None, tail_is_free=lambda lo, hi: True)
    moved_gib = lay.bound_groups * lay.bytes_freed_per_group / GIB
    offload_s, restore_s = [], []
    wait_for_quiet(*quiet)
    with Contention() as load:
        for _ in range(reps):
            start = time.perf_counter()
            rows = rp.offload(lay.bound_groups)
            offload_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            rp.restore(lay.bound_groups)
            restore_s.append(time.perf_counter() - start)
    close_system(backend, staging, stores, kv, rp)
    return {"populate": populate, "moved_mib": moved_gib * 1024, "groups": lay.bound_groups, "rows_added": rows,
                "offload_ms_per_gib": statistics.median(offload_s) * 1e3 / moved_gib,
                "restore_ms_per_gib": statistics.median(restore_s) * 1e3 / moved_gib, "other_cores_busy": load.other_cores}


def moe_forward(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int):
    """Top-k routing, SiLU-gated w13 then w2, one expert at a time (the workload, as moe_forward_native)."""
    weights, ids = torch.topk(torch.softmax(x @ router.T, dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[tok] @ w13[e].T).chunk(2, dim=-1)
        out.index_add_(0, tok, (F.silu(gate) * up @ w2[e].T) * weights[tok, slot, None])
    return out


def forward_s(x, weights, tensors, engine) -> float:
    """One forward over every MoE layer (residual stack); staging hooks as the glue would place them."""
    start = time.perf_counter()
    if engine is not None:
        engine.begin_forward()
    for lid in sorted(weights):
        if engine is not None:
            engine.before_moe(lid)
        x = x + moe_forward(x, weights[lid][2], *tensors[lid], _TINY.top_k)
        if engine is not None:
            engine.after_moe(lid)
    return time.perf_counter() - start


def bench_staging(tokens_list: list[int], reps: int, quiet: tuple[float, float]) -> list[dict]:
    """Interleaved reps of: original weights (0%), one forward's staging copies alone, 25% staged right
    before each layer (sync), 25% prefetched one layer ahead on the worker thread (async)."""
    backend, weights, lay, staging, stores, kv = tiny_system(0.25, 1024)
    original = {lid: w[:2] for lid, w in weights.items()}
    paged = original | {s.layer_id: (s.w13, s.w2) for s in stores}
    for store in stores:
        store.offload_tail_pages(lay.bound_groups)  # the pages stay allocated; the alias is what matters
    engines = {mode: StagingEngine(stores, mode) for mode in ("sync", "async")}
    runs = {"0pct": lambda x: forward_s(x, weights, original, None), "copy": lambda x: copy_s(stores),
            "sync": lambda x: forward_s(x, weights, paged, engines["sync"]),
            "async": lambda x: forward_s(x, weights, paged, engines["async"])}
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, _TINY.hidden, generator=torch.Generator().manual_seed(tokens))
        times: dict[str, list[float]] = {key: [] for key in runs}
        wait_for_quiet(*quiet)
        before = engines["async"].stats()
        with Contention() as load:
            for rep in range(reps + 1):
                for key, run in runs.items():
                    elapsed = run(x)
                    if rep:
                        times[key].append(elapsed)
        after = engines["async"].stats()
        t0, tc, ts, ta = (statistics.median(times[k]) * 1e3 for k in runs)
        rows.append({"tokens": tokens, "staged_mib_per_forward": sum(s.staged_bytes() for s in stores) / MIB,
                     "forward_ms_0pct": t0, "copy_ms_alone": tc, "forward_ms_25pct_sync": ts,
                     "forward_ms_25pct_prefetch": ta, "hidden": (ts - ta) / (ts - t0) if ts > t0 else None,
                     "prefetch_wait_ms": (after.wait_s - before.wait_s) * 1e3 / (reps + 1),
                     "stalls_per_forward": (after.stalls - before.stalls) / (reps + 1),
                     "other_cores_busy": load.other_cores})
    close_system(backend, staging, stores, kv, *engines.values())
    return rows


def copy_s(stores) -> float:
    """One forward's staging copies, back to back on the calling thread."""
    start = time.perf_counter()
    for store in stores:
        for dst, src in store.staging_pairs():
            dst.copy_(src)
    return time.perf_counter() - start


class Contention:
    """CPU cores the REST of the machine kept busy meanwhile (/proc/stat busy time minus our own):
    the box is shared, and a busy second core is what the staging thread needs."""

    def __enter__(self) -> Self:
        self._start = (_busy_s(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = (end - start for end, start in zip((_busy_s(), time.process_time(), time.perf_counter()),
                                                             self._start))
        self.other_cores = max(0.0, (busy - own) / wall)


def wait_for_quiet(max_other_cores: float, max_wait_s: float) -> float:
    """Sample the rest of the machine's load each second until it drops below `max_other_cores` or
    `max_wait_s` passes; returns the last sample (reported, so a noisy figure is visible as such)."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        with Contention() as load:
            time.sleep(1.0)
        if load.other_cores < max_other_cores or time.perf_counter() > deadline:
            return load.other_cores


def _busy_s() -> float:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def table(title: str, rows: list[dict]) -> str:
    keys = list(rows[0])
    cells = [[_fmt(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = [title, "  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and one batch size")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--max-wait-s", type=float, default=0.0,
                        help="before each timed section, wait up to this long for the rest of the machine to "
                             "use fewer than --quiet-below cores (the box is shared)")
    parser.add_argument("--quiet-below", type=float, default=0.3)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per figure (median reported)")
    args = parser.parse_args()
    quiet = (args.quiet_below, args.max_wait_s)
    torch.set_num_threads(1)  # the compute thread leaves the second core to the staging worker
    reps = 2 if args.quick else args.reps
    result = {
        "kv_gain": [kv_gain(name, tp) for name in CONFIGS for tp in (1, 2, 4)],
        "remap": [bench_remap(reps, populate, quiet) for populate in (True, False)],
        "staging": bench_staging([64] if args.quick else [64, 512, 2048], reps, quiet),
    }
    print(table("KV tokens gained per offloaded group (2 MiB pages, VAMP-15 bound)", result["kv_gain"]))
    print()
    print(table("Remap on host pages (tiny model, 50% bound offloaded then restored; restore includes the copy "
                "back from the host copy)", result["remap"]))
    print()
    print(table("Staging: tiny-model MoE forward, 0% vs 25% offloaded", result["staging"]))
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
