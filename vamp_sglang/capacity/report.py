"""The planner's answer as one JSON-ready dict, and the same as a table for a terminal."""

from __future__ import annotations

from typing import Any

from vamp_sglang.capacity.plan import GIB, CapacityModel
from vamp_sglang.capacity.sessions import SessionFootprint, sessions_held, union_tokens


def build_report(name: str, model: CapacityModel, ratios: dict[str, float], trace_path: str | None = None,
                 sessions: list[SessionFootprint] | None = None) -> dict[str, Any]:
    """Per ratio (keys as the operator wrote them) what the pool gains and each decode step stages;
    with a trace, how many of its sessions each pool holds and the smallest ratio that holds them all."""
    d, geo, base = model.deployment, model.geometry, model.baseline
    lay = model.layout(0.0)
    baseline = {"kv_pool_gib_per_gpu": _gib(base.pages_per_buffer * model.kv_buffers * d.page_bytes),
                "kv_pool_tokens": base.tokens, "deployment_tokens": base.tokens * d.pools, "source": base.source,
                "tpot_bound_ms": d.decode_ms}
    report: dict[str, Any] = {
        "model": name, "tp": d.tp, "dp": d.dp, "ep": d.ep, "attention_tp": d.attn_tp, "gpu_mem_gib": d.gpu_mem_gib, "mem_fraction": d.mem_fraction,
        "dtype": d.dtype, "h2d_gbps": d.h2d_gbps, "decode_ms": d.decode_ms, "page_size": d.page_size,
        "geometry": {"local_experts": geo.local_experts, "routed_experts": geo.routed_experts,
                     "moe_intermediate_per_rank": geo.moe_intermediate_per_rank, "group_experts": lay.group_experts,
                     "groups_per_layer": lay.groups_per_layer, "eligible_layers": len(lay.eligible_layer_ids),
                     "kv_bytes_per_token": model.kv_bytes_per_token, "expert_gib_per_gpu": _gib(base.expert_bytes),
                     "expert_scale_gib_per_gpu": _gib(geo.expert_scale_bytes_per_layer * len(geo.moe_layer_ids)),
                     "expert_weights": geo.expert_quant.describe() if geo.expert_quant else d.dtype,
                     "attention": "mla" if geo.mla_latent_dim else "mha", "kv_buffers": model.kv_buffers,
                     "dense_weight_gib_per_gpu": _gib(base.dense_bytes)},
        "baseline": baseline, "ratios": {}, "recommendation": None,
    }
    if model.draft is not None:
        report["draft"] = model.draft.to_json()
    for key, ratio in ratios.items():
        p = model.plan(ratio)
        report["ratios"][key] = {
            "offloaded_groups": p.offloaded_groups,
            "offload_ratio": round(p.offloaded_groups * lay.group_experts / geo.local_experts, 6),
            "reclaimed_gib_per_gpu": _gib(p.reclaimed_bytes), "reclaimed_bytes_per_gpu": p.reclaimed_bytes,
            "kv_pool_gib_per_gpu": _gib(p.kv_pool_bytes), "kv_pool_tokens": p.kv_pool_tokens,
            "deployment_tokens": p.kv_pool_tokens * d.pools,
            "staged_bytes_per_step": p.staged_bytes_per_step, "staged_gib_per_step": _gib(p.staged_bytes_per_step),
            "tpot_bound_ms": round(p.tpot_bound_ms, 3)}
    if sessions is not None:
        footprint = union_tokens(sessions)
        report["trace"] = {"path": trace_path, "sessions": len(sessions), "peak_footprint_tokens": footprint,
                           "largest_session_tokens": max(s.tokens for s in sessions)}
        candidates = [("0", baseline)] + sorted(report["ratios"].items(), key=lambda kv: ratios[kv[0]])
        for _, row in candidates:
            row["sessions_held"] = sessions_held(sessions, row["kv_pool_tokens"])
            row["holds_trace"] = row["kv_pool_tokens"] >= footprint
        fits = [(key, row) for key, row in candidates if row["holds_trace"]]
        report["recommendation"] = (
            {"ratio": fits[0][0], "kv_pool_tokens": fits[0][1]["kv_pool_tokens"],
             "tpot_bound_ms": fits[0][1]["tpot_bound_ms"], "sessions_held": fits[0][1]["sessions_held"]}
            if fits else {"ratio": None, "reason": f"no ratio given holds the trace's {footprint} tokens; the "
                          f"largest pool holds {candidates[-1][1]['sessions_held']} of {len(sessions)} sessions"})
    return report


def format_table(report: dict[str, Any]) -> str:
    b, geo = report["baseline"], report["geometry"]
    lines = [(f"{report['model']} on {report['tp']} GPU(s) of {report['gpu_mem_gib']} GiB, mem fraction "
             f"{report['mem_fraction']}, {report['dtype']} ({geo['attention'].upper()} KV, experts "
             f"{geo['expert_weights']}): experts {geo['expert_gib_per_gpu']:.2f} GiB + other "
             f"weights {geo['dense_weight_gib_per_gpu']:.2f} GiB per GPU; groups of {geo['group_experts']} "
             f"experts, {geo['eligible_layers']} eligible layers"),
             f"staging at {report['h2d_gbps']} GB/s host-to-device, decode step {report['decode_ms']} ms"]
    if report["dp"] > 1:
        lines.append(f"DP attention: {report['dp']} DP ranks of attention-TP {report['attention_tp']}, one pool each "
                     f"(pool tokens per DP rank; the deployment holds {report['dp']} x as many distinct tokens)")
    if "draft" in report:
        dr = report["draft"]
        lines.append(f"draft ({dr['algorithm']}): {dr['layers']} layer(s), {dr['kv_bytes_per_token']} KV bytes a token "
                     f"in the cell, {dr['kv_buffers']} more buffers growing with the target's; weights "
                     f"{dr['weight_bytes_per_gpu'] / GIB:.2f} GiB per GPU ({dr['expert_bytes_per_gpu'] / GIB:.2f} "
                     "GiB routed experts, resident)")
        if dr["state_bytes_per_gpu"]:
            split = (f": state slots {dr['state_slots_without_draft']} -> {dr['state_slots_per_gpu']}, the KV "
                     f"pool gains {dr['kv_bytes_from_state_share'] / GIB:.2f} GiB (slots without a draft left out)"
                     if dr["state_slots_per_gpu"] is not None else " (the measured pool is after it)")
            lines.append(f"  per-draft-token state {dr['state_bytes_per_gpu'] / GIB:.2f} GiB from SGLang's "
                         f"state share{split}")
    if report["ep"] > 1:
        lines.append(f"expert parallelism: EP {report['ep']}, each rank holds {geo['local_experts']} of the "
                     f"{geo['routed_experts']} routed experts, split over tp / ep = {report['tp'] // report['ep']} "
                     f"(intermediate {geo['moe_intermediate_per_rank']} per rank); groups and pools per rank")
    trace = "sessions_held" in b
    head = f"{'ratio':>8} {'groups':>6} {'reclaimed GiB':>13} {'pool GiB':>9} {'pool tokens':>12} " \
           f"{'staged GiB/step':>15} {'TPOT bound ms':>13}" + (f" {'sessions':>8}" if trace else "")
    lines += ["", head]
    rows = [("0", {**b, "offloaded_groups": 0, "reclaimed_gib_per_gpu": 0.0, "staged_gib_per_step": 0.0})]
    for key, row in [*rows, *report["ratios"].items()]:
        lines.append(f"{key:>8} {row['offloaded_groups']:>6} {row['reclaimed_gib_per_gpu']:>13.2f} "
                     f"{row['kv_pool_gib_per_gpu']:>9.2f} {row['kv_pool_tokens']:>12} "
                     f"{row['staged_gib_per_step']:>15.2f} {row['tpot_bound_ms']:>13.1f}"
                     + (f" {row['sessions_held']:>8}" if trace else ""))
    lines.append(f"(baseline pool: {b['source']})")
    if trace:
        t, rec = report["trace"], report["recommendation"]
        lines.append(f"trace {t['path']}: {t['sessions']} sessions, peak reusable prefix footprint "
                     f"{t['peak_footprint_tokens']} tokens")
        lines.append(f"recommendation: ratio {rec['ratio']} ({rec['kv_pool_tokens']} tokens, TPOT bound "
                     f"{rec['tpot_bound_ms']:.1f} ms)" if rec["ratio"] is not None else
                     f"recommendation: none; {rec['reason']}")
    return "\n".join(lines)


def _gib(nbytes: int) -> float:
    return round(nbytes / GIB, 4)
