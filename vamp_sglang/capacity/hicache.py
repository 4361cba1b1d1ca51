"""The capacity planner with HiCache (`--hicache-gib`, issue 22): per offload ratio, the device KV tokens, the host
KV tokens HiCache's host pool holds, the host memory both tiers take, and the two costs on the one host link.

Per TP rank: HiCache's host pool holds the rank's KV slice, `hicache_gib` GiB of it, so host tokens =
hicache bytes / the rank's KV bytes per token. The two link costs at the stated `--h2d-gbps`:
- staging per decode step: the offloaded experts copied in before their MoE kernels (the ratio's staged bytes);
- load per host hit: a prefix's KV bytes copied back from the host pool, per 1,000 tokens of the hit.
Host memory per rank: the offloaded experts' host copies (the reclaimed bytes) plus the host pool, which the
server checks against the host's free memory at start (integration/cache/hicache_tier.py). Arithmetic only.
"""

from __future__ import annotations

from typing import Any

from vamp_sglang.capacity.plan import GIB, CapacityModel

HIT_TOKENS = 1000  # the load cost is stated per this many tokens of a host hit


def hicache_report(model: CapacityModel, ratios: dict[str, float], hicache_gib: float) -> dict[str, Any]:
    """The `hicache` section of the planner's report."""
    d, geo = model.deployment, model.geometry
    host_bytes = int(hicache_gib * GIB)
    host_tokens = host_bytes // geo.kv_bytes_per_token
    load_ms = geo.kv_bytes_per_token * HIT_TOKENS / (d.h2d_gbps * 1e9) * 1e3
    rows = {"0": _row(model.baseline.tokens, host_tokens, 0, 0.0, load_ms, host_bytes)}
    for key, ratio in ratios.items():
        p = model.plan(ratio)
        rows[key] = _row(p.kv_pool_tokens, host_tokens, p.reclaimed_bytes, p.staging_ms, load_ms, host_bytes)
    return {"hicache_gib_per_gpu": hicache_gib, "host_tokens": host_tokens, "h2d_gbps": d.h2d_gbps,
            "load_ms_per_1k_hit_tokens": round(load_ms, 4), "ratios": rows}


def _row(device_tokens: int, host_tokens: int, expert_host_bytes: int, staging_ms: float, load_ms: float,
         host_bytes: int) -> dict[str, Any]:
    return {"device_tokens": device_tokens, "host_tokens": host_tokens,
            "staging_ms_per_decode_step": round(staging_ms, 3), "load_ms_per_1k_hit_tokens": round(load_ms, 4),
            "host_gib_per_gpu": round((expert_host_bytes + host_bytes) / GIB, 4)}


def format_hicache(section: dict[str, Any]) -> list[str]:
    title = (f"HiCache: {section['hicache_gib_per_gpu']} GiB host pool per GPU = {section['host_tokens']} tokens; "
             f"link at {section['h2d_gbps']} GB/s (assumed)")
    head = (f"{'ratio':>8} {'device tokens':>13} {'host tokens':>12} {'staging ms/step':>15} "
            f"{'load ms/1k hit':>14} {'host GiB':>9}")
    lines = ["", title, head]
    for key, row in section["ratios"].items():
        lines.append(f"{key:>8} {row['device_tokens']:>13} {row['host_tokens']:>12} "
                     f"{row['staging_ms_per_decode_step']:>15.3f} {row['load_ms_per_1k_hit_tokens']:>14.4f} "
                     f"{row['host_gib_per_gpu']:>9.2f}")
    return lines
