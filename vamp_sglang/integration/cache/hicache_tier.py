"""HiCache's host tier as VAMP sees it (issue 22, docs/hicache.md): one host-memory budget, the measured
host-to-device load rate the planner prices evictions with, and the host-tier hits `/vamp/stats` reports.

- Budget: the offloaded experts' host copies (one arena sized for the offload bound, allocated when the model
  is paged: `memory.experts.host_copy_bytes`) and HiCache's host KV pool (`MHATokenToKVPoolHost`, allocated by
  `UnifiedRadixCache.init_hicache`) share host memory. At scheduler start the part of both not yet resident
  must fit in what this process can still use (SGLang's own `available_host_memory_bytes`, cgroup-aware,
  which already counts as used the expert copies, written at start, and the pool where SGLang page-locked it
  with `cudaHostRegister`, i.e. on CUDA); otherwise the start fails with both sizes named. SGLang checks the pool
  against its own budget before allocating it (pool_host/base.py:248-256), the expert copies already in.
- Load rate: a timed copy of part of the host pool into a scratch device tensor at start, then (CPU mode) every
  HiCache load the direct-backend hook performs (cpu/hicache.py), as an EMA of seconds per token
  (`load_s_per_token`). The planner gets it agreed over TP ranks (plan_inputs.PlanInputs.host_load_s_per_token).
- Hits: each admitted request's device and host cached tokens (`Req.cached_tokens_device/_host`, computed in
  `ScheduleBatch.prepare_for_extend`), counted once per request.
- Staging beside loads (VAMP on): after every forward run while experts are offloaded, the staging engine's wait
  in it (the figure the TPOT guard charges to offloading, step_measurements.py), for decode forwards and for
  extend forwards with and without a HiCache host load submitted for their batch (`hicache_consumer_index >= 0`
  when the batch was built, SGLang's own test; the index then stays on the batch that goes on decoding, so only
  the extend forward of the batch it was set for counts). SGLang submits loads only while it builds a prefill
  batch. On CPU such a load is a synchronous copy made then, before the forward starts its staging copies, so
  the two never run at the same time; on a GPU it runs on the host-to-device stream under the forward, with
  overlap scheduling possibly under the decode forward before it too (not told apart here), and staging waits
  are read back from events later, so a step's figure can land in a later step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vamp_sglang.integration.hooks import Hook

logger = logging.getLogger(__name__)

GIB = 1024**3
PROBE_BYTES = 64 * 1024**2  # the start-up copy (or the whole host pool when smaller)
EMA_WEIGHT = 0.2

_tier: HostTier | None = None  # this scheduler process's tier (one scheduler per process)


class HostBudgetError(RuntimeError):
    """The expert host copies and HiCache's host pool do not fit in host memory together."""


def check_host_budget(expert_host_bytes: int, hicache_host_bytes: int, hicache_resident_bytes: int,
                      available_bytes: int) -> None:
    """Both must fit: `available_bytes` is what SGLang measures as still allocatable now, which already
    excludes the expert copies (written at start) and the part of HiCache's pool already resident
    (`hicache_resident_bytes`: on CUDA the whole pool, page-locked by `cudaHostRegister`; on CPU none of it,
    allocated and not yet touched). Only the rest is new; counting the resident part again refused valid
    starts, and TP ranks pinning at once could disagree (issue 48)."""
    new_bytes = hicache_host_bytes - hicache_resident_bytes
    if new_bytes > available_bytes:
        raise HostBudgetError(
            f"vamp: host memory cannot hold both the offloaded experts' host copies "
            f"({expert_host_bytes / GIB:.2f} GiB, --vamp-max-offload-ratio) and HiCache's host KV pool "
            f"({hicache_host_bytes / GIB:.2f} GiB, --hicache-ratio / --hicache-size, "
            f"{new_bytes / GIB:.2f} GiB of it not yet resident): "
            f"{available_bytes / GIB:.2f} GiB is available once the expert copies are in; lower one of them")


def resident_pool_bytes(host_pool: Any) -> int:
    """The bytes of HiCache's host pool already counted as used: the ranges SGLang page-locked with
    `cudaHostRegister` (`alloc_with_host_register`, sglang/srt/mem_cache/pool_host/common.py:330-350; pinning
    faults every page in), which it records on the buffer (`_cuda_host_register`, `:192`). CPU mode registers
    nothing (cpu/hicache.py), so there the pool is still to come."""
    from sglang.srt.mem_cache.pool_host.common import _CUDA_HOST_REGISTERED_RANGES_ATTR

    ranges: set[tuple[int, int]] = set()
    for name in ("kv_buffer", "k_buffer", "v_buffer"):
        buffers = getattr(host_pool, name, None)
        for buffer in buffers if isinstance(buffers, (list, tuple)) else [buffers]:
            ranges.update(getattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, None) or ())
    return sum(size for _, size in ranges)


class HostTier:
    """Sizes, the measured load rate and the hit counters of one scheduler's HiCache host tier."""

    def __init__(self, host_pool: Any, expert_host_bytes: int) -> None:
        self.host_pool = host_pool
        self.bytes_per_token = int(host_pool.size_per_token)
        self.host_pool_tokens = int(host_pool.size)
        self.host_pool_bytes = self.host_pool_tokens * self.bytes_per_token
        self.write_back = False  # HiCache's --hicache-write-policy write_back (set at setup)
        self.expert_host_bytes = int(expert_host_bytes)
        self.load_s_per_token: float | None = None
        self.loaded_tokens = 0
        self.load_s = 0.0
        self.host_hit_tokens = 0
        self.device_hit_tokens = 0
        self.expert_memory: Any | None = None  # VAMP on: whose staging engine's wait is split by loads
        self._staging_wait_seen_s = 0.0
        self.load_batch: Any | None = None  # the prefill batch just built with a host load submitted for it
        # extend_with_load / extend_without_load / decode -> [forwards, staging wait s, tokens (extend) or requests]
        self.staging_by_load = {kind: [0, 0.0, 0] for kind in ("extend_with_load", "extend_without_load", "decode")}

    def observe_load(self, tokens: int, seconds: float) -> None:
        """Fold one HiCache load (all layers of `tokens` tokens in `seconds`) into the rate."""
        if tokens <= 0 or seconds <= 0:
            return
        self.loaded_tokens += tokens
        self.load_s += seconds
        rate = seconds / tokens
        previous = self.load_s_per_token
        self.load_s_per_token = rate if previous is None else previous + EMA_WEIGHT * (rate - previous)

    def observe_forward(self, kind: str, size: int) -> None:
        """After one forward of `kind` (a key of staging_by_load): its staging wait, counted while experts are
        offloaded (a forward without offloaded experts waits for nothing)."""
        wait_s = float(self.expert_memory.experts.engine.stats().wait_s)
        waited_s, self._staging_wait_seen_s = wait_s - self._staging_wait_seen_s, wait_s
        if not self.expert_memory.offloaded_groups:
            return
        row = self.staging_by_load[kind]
        row[0] += 1
        row[1] += waited_s
        row[2] += size

    def probe(self, device: torch.device) -> None:
        """Time one host-to-device copy of part of the host pool (best of three)."""
        device = torch.device(device)
        flat = self.host_pool.kv_buffer.reshape(-1).view(torch.uint8)
        n = min(PROBE_BYTES, flat.numel())
        if n <= 0:
            return
        scratch = torch.empty(n, dtype=torch.uint8, device=device)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            scratch.copy_(flat[:n])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        self.observe_load(max(1, n // max(1, self.bytes_per_token)), best)
        self.loaded_tokens = 0  # the probe is no HiCache load
        self.load_s = 0.0

    def stats(self) -> dict[str, Any]:
        return {"hicache": {
            "host_pool_tokens": self.host_pool_tokens, "host_pool_bytes": self.host_pool_bytes,
            "expert_host_bytes": self.expert_host_bytes,
            "host_bytes_total": self.host_pool_bytes + self.expert_host_bytes,
            "host_hit_tokens": self.host_hit_tokens, "device_hit_tokens": self.device_hit_tokens,
            "loaded_tokens": self.loaded_tokens, "load_s": round(self.load_s, 6),
            "load_us_per_token": None if self.load_s_per_token is None else round(self.load_s_per_token * 1e6, 4),
            **({} if self.expert_memory is None else {"staging_by_load": {
                kind: {"steps": steps, "staging_wait_s": round(wait_s, 6), "requests" if kind == "decode"
                       else "tokens": size} for kind, (steps, wait_s, size) in self.staging_by_load.items()}})}}


def host_pool_of(tree_cache: Any) -> Any:
    """HiCache's host KV pool, or None when HiCache is off."""
    controller = getattr(tree_cache, "cache_controller", None)
    return getattr(controller, "mem_pool_host", None) if controller is not None else None


def current() -> HostTier | None:
    return _tier


def setup_scheduler(scheduler: Any, runtime: Any) -> None:
    """With HiCache on: check the budget, measure the load rate, add the `/vamp/stats` section."""
    global _tier
    host_pool = host_pool_of(scheduler.tree_cache)
    if host_pool is None:
        return
    from sglang.srt.mem_cache.host_memory import available_host_memory_bytes

    from vamp_sglang.cpu import hicache as cpu_hicache
    from vamp_sglang.memory.experts import host_copy_bytes

    memory = getattr(runtime, "expert_memory", None)
    expert_bytes = host_copy_bytes(memory.layout) if memory is not None and memory.layout.bound_groups else 0
    tier = HostTier(host_pool, expert_bytes)
    tier.write_back = scheduler.tree_cache.cache_controller.write_policy == "write_back"
    resident = min(resident_pool_bytes(host_pool), tier.host_pool_bytes)
    available = available_host_memory_bytes(allow_cgroup_fallback=True)
    check_host_budget(expert_bytes, tier.host_pool_bytes, resident, available)
    tier.probe(torch.device(getattr(scheduler.token_to_kv_pool_allocator, "device", "cpu")))
    cpu_hicache.LOAD_OBSERVERS[:] = [tier.observe_load]
    logger.info("vamp: HiCache host pool %.2f GiB (%d tokens) + expert host copies %.2f GiB; load %.3f us/token",
                tier.host_pool_bytes / GIB, tier.host_pool_tokens, expert_bytes / GIB,
                (tier.load_s_per_token or 0.0) * 1e6)
    tier.expert_memory = memory
    _tier = runtime.host_tier = tier
    runtime.extensions.append(tier)


def _after_prepare_for_extend(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """Count each admitted request's device and host cached tokens once (SGLang computes them just now)."""
    tier = _tier
    if tier is None:
        return
    tier.load_batch = batch if getattr(batch, "hicache_consumer_index", -1) >= 0 else None
    for req in batch.reqs:
        if getattr(req, "_cache_breakdown_computed", False) and not getattr(req, "vamp_tier_counted", False):
            req.vamp_tier_counted = True
            tier.host_hit_tokens += int(req.cached_tokens_host)
            tier.device_hit_tokens += int(req.cached_tokens_device)


def _after_run_batch(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """Count the forward's staging wait as a decode's or an extend's, with or without a host load for its batch."""
    tier = _tier
    if tier is None or tier.expert_memory is None:
        return
    mode = batch.forward_mode
    if mode.is_decode():
        tier.observe_forward("decode", len(batch.reqs))
    elif mode.is_extend():
        loaded, tier.load_batch = tier.load_batch is batch, None
        tier.observe_forward("extend_with_load" if loaded else "extend_without_load", int(batch.extend_num_tokens or 0))


HOOKS = [
    Hook("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend", "after", _after_prepare_for_extend,
         "HiCache: count each admitted request's device and host cached tokens for /vamp/stats"),
    Hook("sglang.srt.managers.scheduler.Scheduler.run_batch", "after", _after_run_batch,
         "HiCache + VAMP: each forward's staging wait, extend forwards split by a host load for their batch"),
]
