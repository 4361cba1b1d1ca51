"""gpu_check section `hicache_budget` (issue 48, defect 4): the HiCache host budget after SGLang page-locks
its host pool. SGLang allocates the pool and registers it with `cudaHostRegister`
(sglang/srt/mem_cache/pool_host/common.py:330-350) before VAMP's check runs; pinning faults every page in,
so MemAvailable (what psutil's `available`, and so SGLang's `available_host_memory_bytes`, reads) already
excludes it. Here a host buffer of 60% of MemAvailable stands for the pool, registered through torch's
cudart as SGLang does: MemAvailable must drop by about its size, and VAMP's check
(`hicache_tier.check_host_budget`, the pool's registered bytes counted as resident) must accept the start
SGLang admitted, which the check as it was (the whole pool counted again) refused."""

from __future__ import annotations

import torch

from vamp_sglang.integration.cache.hicache_tier import HostBudgetError, check_host_budget
from vamp_sglang.memory.backend import PageBackend

POOL_FRACTION = 0.6


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (psutil's `available` on Linux)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _refused(pool_bytes: int, resident_bytes: int, available_bytes: int) -> bool:
    try:
        check_host_budget(0, pool_bytes, resident_bytes, available_bytes)
    except HostBudgetError:
        return True
    return False


def check(backend: PageBackend, gpu: bool) -> dict:
    """The HiCache host budget after cudaHostRegister of a buffer of 60% of MemAvailable (as SGLang pins its
    host pool before VAMP's check): accepted now, refused by the check as it was."""
    before = mem_available_bytes()
    pool_bytes = int(before * POOL_FRACTION) // (1 << 21) << 21
    pool = torch.empty(pool_bytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(pool.data_ptr(), pool_bytes, 0))
    if rc != 0:
        return {"ok": False, "error": f"cudaHostRegister of {pool_bytes} bytes failed: rc={rc}"}
    try:
        after = mem_available_bytes()
        result = {
            "pool_gib": round(pool_bytes / 2**30, 2), "mem_available_before_gib": round(before / 2**30, 2),
            "mem_available_after_gib": round(after / 2**30, 2),
            "registration_counted_as_used": before - after >= 0.9 * pool_bytes,
            "accepted": not _refused(pool_bytes, pool_bytes, after),
            "refused_when_counted_twice": _refused(pool_bytes, 0, after),
        }
    finally:
        cudart.cudaHostUnregister(pool.data_ptr())
        del pool
    result["ok"] = result["registration_counted_as_used"] and result["accepted"]
    return result
