"""What VAMP's offloaded experts cost per decode step on real GPUs, by staging mode, from real routing (issue 49).

Replays routing traces (eval/decode_cost_traces.py: continuous batching over B lanes, or a real engine's
steps) through VAMP's residency and staging arithmetic (eval/decode_cost_replay.py: ExpertLayout, the
planner's geometry, routed.py) with no model weights, and prices each decode step with a named GPU profile
and a host CPU (eval/decode_cost_model.py, where every constant and its source is stated). Per trace, batch
and mode it reports the bytes staged per step on one GPU, the token-expert pairs computed on the host and
the weight bytes they read, and the modelled TPOT against the no-offload step.

Modes: `whole` (paper IV-D), `routed` (issue 12), `routed+order` (the offloaded set is the coldest experts
by decayed routing frequency, reordered every 64 steps; the server reorders at its offloads and restores,
`--vamp-expert-order routing`), `routed+cache` (rows the
aliased staging slots still hold from this layer's last step are not copied again), `host` (cold experts'
tokens computed on the host; the server's `--vamp-staging host` on CPU only), `auto` (per step the cheapest of whole, routed and
host, as an oracle would pick).

Validation: Qwen3-Next-80B, TP 2, VAMP-15, `h100-pcie`, whole staging, at the paper's no-offload TPOT of
170.9 ms (Table IV; the paper's load, 128 decode tokens a step, Table I's batch limit) against its 224.0 ms.

    .venv/bin/python -m eval.bench_decode_cost --json results/decode_cost/decode_cost.json \
        --plot results/decode_cost/decode_cost.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eval.decode_cost_model import PROFILES, HostCpu, Profile, load_host
from eval.decode_cost_replay import RoutingOrder, SlotCache, check_with_routed_py, count_step, residency
from eval.decode_cost_traces import DATA_DIR, TRACES, Trace, TraceError, UniformTrace, load_trace
from vamp_sglang.capacity.models import ModelConfigError, load_model_config
from vamp_sglang.capacity.weights import dense_weight_bytes
from vamp_sglang.memory.geometry import GeometryError, geometry_from_config

MODES = ("whole", "routed", "routed+order", "routed+cache", "host", "auto")
PAPER = {"baseline_tpot_ms": 170.9, "tpot_ms": 224.0, "batch": 128, "model": "qwen3-next-80b-a3b", "tp": 2,
         "ratio": 0.15, "profile": "h100-pcie"}
# Qwen1.5-MoE-A2.7B (the vLLM trace's model), from its Hugging Face config.json; not a planner built-in.
EVAL_MODELS = {"qwen1.5-moe-a2.7b": {
    "model_type": "qwen2_moe", "num_hidden_layers": 24, "hidden_size": 2048, "intermediate_size": 5632,
    "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}}
HALFLIFE_STEPS, REORDER_STEPS, CHECK_STEPS = 2000.0, 64, 4


def model_config(name: str) -> dict:
    return dict(EVAL_MODELS[name]) if name in EVAL_MODELS else load_model_config(name)[1]


def replay(trace: Trace, model: str, tp: int, ratio: float, profile: Profile, host: HostCpu, batch: int,
           max_steps: int, baseline_ms: float | None = None) -> dict:
    """Per mode: mean staged bytes, host pairs and host bytes read per step, mean TPOT and no-offload TPOT."""
    config = model_config(model)
    geo = geometry_from_config(config, tp, "bfloat16")
    if (geo.local_experts, int(config["num_experts_per_tok"])) != (trace.experts, trace.top_k):
        raise TraceError(f"--model {model} routes top-{config['num_experts_per_tok']} of {geo.local_experts} "
                         f"experts, --trace {trace.name} top-{trace.top_k} of {trace.experts}")
    res = residency(geo, ratio, trace)
    dense_s = dense_weight_bytes(config, tp, "bfloat16") / profile.hbm_bytes_per_s
    window_layers = geo.num_layers
    elig_idx = list(range(len(res.layout.eligible_layer_ids)))
    if hasattr(trace, "layer_ids"):  # a trace of a few layers: their places among the eligible layers
        elig_idx = [res.layout.eligible_index(i) for i in trace.layer_ids[res.trace_first_eligible:]]
    order = RoutingOrder(trace.layers - res.trace_first_eligible, res, HALFLIFE_STEPS, REORDER_STEPS)
    cache = SlotCache(res, elig_idx) if res.layer_scale == 1.0 else None
    sums = {m: np.zeros(5) for m in MODES}  # staged bytes, host pairs, host bytes read, extra s, no-offload s
    steps = tokens = 0
    row, link = res.row_bytes, profile.link_bytes_per_s
    whole_bytes = res.whole_bytes_per_step
    for ids in trace.steps(batch, max_steps):
        ids = ids[res.trace_first_eligible:]
        base = count_step(ids, None, res)
        if steps < CHECK_STEPS:
            check_with_routed_py(ids, None, res, base)
        ordered = count_step(ids, order.perm, res)
        if steps < CHECK_STEPS:
            check_with_routed_py(ids, order.perm, res, ordered)
        moved_bytes = order.observe(ids)
        scale = res.layer_scale
        distinct = float(np.mean(base.rows + base.resident_rows))
        t0 = baseline_ms / 1e3 if baseline_ms else \
            len(geo.moe_layer_ids) * profile.moe_s(distinct * row) + dense_s
        whole_s = res.eligible_layers * max(0.0, res.offloaded * row / link - t0 / window_layers)
        routed_b = scale * float(base.rows.sum()) * row
        order_b = scale * float(ordered.rows.sum()) * row + moved_bytes
        rtt = host.round_trip_s(base.tokens, geo.hidden_size, link)
        host_s = scale * sum(max(0.0, rtt + host.layer_s(cold, row) - profile.moe_s(res_rows * row))
                             for cold, res_rows in zip(base.cold_tokens, base.resident_rows, strict=True)
                             if cold.size)
        pairs, read_b = scale * float(base.pairs.sum()), routed_b
        per_mode = {"whole": (whole_bytes, 0.0, 0.0, whole_s), "routed": (routed_b, 0.0, 0.0, routed_b / link),
                    "routed+order": (order_b, 0.0, 0.0, order_b / link), "host": (0.0, pairs, read_b, host_s)}
        if cache is not None:
            cache_b = scale * cache.step(base.routed_rows) * row
            per_mode["routed+cache"] = (cache_b, 0.0, 0.0, cache_b / link)
        per_mode["auto"] = min((per_mode[m] for m in ("whole", "routed", "host")), key=lambda v: v[3])
        for mode, values in per_mode.items():
            sums[mode] += (*values, t0)
        steps += 1
        tokens += base.tokens
    if not steps:
        raise TraceError(f"--trace {trace.name}: no decode step at batch {batch}")
    out = {"tokens_per_step": tokens / steps, "steps": steps, "offloaded_experts_per_layer": res.offloaded,
           "eligible_layers": res.eligible_layers, "whole_bytes_per_step": whole_bytes, "modes": {}}
    for mode, (staged, pairs, read, extra, base_s) in sums.items():
        if mode == "routed+cache" and cache is None:
            continue
        out["modes"][mode] = {"staged_bytes_per_step": staged / steps, "host_pairs_per_step": pairs / steps,
                              "host_bytes_read_per_step": read / steps, "tpot_ms": (base_s + extra) / steps * 1e3,
                              "no_offload_tpot_ms": base_s / steps * 1e3, "tpot_overhead": extra / base_s}
    if cache is not None and cache.needed:
        out["cache"] = {"slot_hit_rate": cache.slot_hits / cache.needed, "lru_bound_hit_rate": cache.lru_hits /
                        cache.needed, "capacity_rows": cache.capacity}
    return out


def validation(host: HostCpu, steps: int) -> dict:
    """The paper's setting: whole staging's modelled TPOT, and the best mode's, at its 170.9 ms baseline."""
    geo = geometry_from_config(model_config(PAPER["model"]), PAPER["tp"], "bfloat16")
    trace = UniformTrace(geo.local_experts, 10, len(geo.moe_layer_ids))
    result = replay(trace, PAPER["model"], PAPER["tp"], PAPER["ratio"], PROFILES[PAPER["profile"]], host,
                    PAPER["batch"], steps, baseline_ms=PAPER["baseline_tpot_ms"])
    modes = result["modes"]
    best = min(modes, key=lambda m: modes[m]["tpot_ms"])
    return {"paper_tpot_ms": PAPER["tpot_ms"], "modelled_tpot_ms": round(modes["whole"]["tpot_ms"], 1),
            "best_mode": best, "best_mode_tpot_ms": round(modes[best]["tpot_ms"], 1)}


def rows_for(name: str, model: str, tp: int, ratio: float, profile: str, batch: int, result: dict) -> list[dict]:
    whole = result["whole_bytes_per_step"]
    return [{"trace": name, "model": model, "tp": tp, "ratio": ratio, "profile": profile, "batch": batch,
             "mode": mode, "staged_bytes_per_step": round(m["staged_bytes_per_step"]),
             "staged_ratio_to_whole": round(m["staged_bytes_per_step"] / whole, 4) if whole else 0.0,
             "host_pairs_per_step": round(m["host_pairs_per_step"], 2), "tpot_overhead": round(m["tpot_overhead"], 4)}
            for mode, m in result["modes"].items()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_decode_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=",".join(TRACES), help=f"comma-separated: {', '.join(TRACES)} or "
                        ".npz paths (default: all four)")
    parser.add_argument("--model", help="model for every trace (default: each trace's own, see decode_cost_traces)")
    parser.add_argument("--tp", type=int, help="TP degree (default: each trace's)")
    parser.add_argument("--ratio", type=float, default=0.15, help="VAMP-r offload ratio (default 0.15)")
    parser.add_argument("--profile", default="h100-pcie", help=f"comma-separated: {', '.join(PROFILES)}")
    parser.add_argument("--batch", default="1,4,8,16,32,64", help="decode batch sizes (default 1,4,8,16,32,64)")
    parser.add_argument("--max-steps", type=int, default=512, help="decode steps replayed per point (default 512)")
    parser.add_argument("--host-json", type=Path, default=Path("results/decode_cost/host_experts.json"),
                        help="bench_host_experts.py's measurements (make bench-host-experts)")
    parser.add_argument("--link-latency-us", type=float, default=10.0,
                        help="assumed latency of each host round-trip direction, us (default 10; not measured)")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="the routing-data npz folder")
    parser.add_argument("--json", type=Path, help="write {validation, rows}; details go to *.details.json")
    parser.add_argument("--plot", type=Path, help="staged bytes and TPOT overhead against batch, per mode (PNG)")
    args = parser.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        parser.error(f"--batch must be comma-separated integers (got {args.batch!r})")
    if any(b < 1 for b in args.batches):
        parser.error(f"--batch sizes must be positive (got {args.batch!r})")
    if not 0.0 <= args.ratio < 1.0:
        parser.error(f"--ratio must be in [0, 1) (got {args.ratio})")
    if args.tp is not None and args.tp < 1:
        parser.error(f"--tp must be a positive integer (got {args.tp})")
    if args.link_latency_us < 0:
        parser.error(f"--link-latency-us must be >= 0 (got {args.link_latency_us})")
    if args.max_steps < 1:
        parser.error(f"--max-steps must be positive (got {args.max_steps})")
    args.profiles = args.profile.split(",")
    unknown = [p for p in args.profiles if p not in PROFILES]
    if unknown:
        parser.error(f"--profile {','.join(unknown)}: not one of {', '.join(PROFILES)}")
    args.traces = args.trace.split(",")
    try:
        args.host = load_host(args.host_json, args.link_latency_us * 1e-6)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check = validation(args.host, 32)
    rows, details = [], []
    points = [(t, p, b) for t in args.traces for p in args.profiles for b in args.batches]
    loaded: dict[str, Trace] = {}
    for name, profile, batch in tqdm(points, desc="replaying traces (trace x profile x batch)"):
        spec = TRACES.get(name)
        model = args.model or (spec.model if spec else None)
        tp = args.tp or (spec.tp if spec else 1)
        try:
            if model is None:
                raise TraceError(f"--trace {name}: not a named trace, so --model is needed")
            if name not in loaded:
                if name == "uniform":
                    geo = geometry_from_config(model_config(model), tp, "bfloat16")
                    loaded[name] = UniformTrace(geo.local_experts, int(model_config(model)["num_experts_per_tok"]),
                                                len(geo.moe_layer_ids))
                else:
                    loaded[name] = load_trace(name, args.data_dir)
            result = replay(loaded[name], model, tp, args.ratio, PROFILES[profile], args.host, batch,
                            args.max_steps)
        except (TraceError, ModelConfigError, GeometryError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        rows += rows_for(loaded[name].name, model, tp, args.ratio, profile, batch, result)
        details.append({"trace": loaded[name].name, "model": model, "tp": tp, "profile": profile, "batch": batch,
                        **result})
    print_table(check, details)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"validation": check, "rows": rows}, indent=1) + "\n")
        meta = {"profiles": {n: p.source for n, p in PROFILES.items()}, "host": args.host.source,
                "link_latency_us": args.link_latency_us,
                "max_steps": args.max_steps, "ratio": args.ratio}
        args.json.with_suffix(".details.json").write_text(json.dumps({"meta": meta, "points": details}, indent=1))
    if args.plot:
        from eval.decode_cost_plot import plot

        plot(details, args.plot)
    return 0


def print_table(check: dict, details: list[dict]) -> None:
    print(f"validation (paper setting, whole staging): modelled {check['modelled_tpot_ms']} ms vs the paper's "
          f"{check['paper_tpot_ms']} ms; best mode {check['best_mode']} {check['best_mode_tpot_ms']} ms")
    print(f"{'trace':<18}{'profile':<10}{'batch':>5} {'mode':<13}{'staged MB/step':>15}{'host pairs':>11}"
          f"{'TPOT ms':>9}{'base ms':>9}{'overhead':>10}")
    for point in details:
        for mode, m in point["modes"].items():
            print(f"{point['trace']:<18}{point['profile']:<10}{point['batch']:>5} {mode:<13}"
                  f"{m['staged_bytes_per_step'] / 1e6:>15.1f}{m['host_pairs_per_step']:>11.1f}{m['tpot_ms']:>9.2f}"
                  f"{m['no_offload_tpot_ms']:>9.2f}{m['tpot_overhead']:>10.1%}")


if __name__ == "__main__":
    sys.exit(main())
