"""HiCache (`--enable-hierarchical-cache`) on SGLang 0.5.23's CPU path: the three gaps, answered in plain torch.

HiCache is `UnifiedRadixCache.init_hicache` (mem_cache/unified_radix_cache.py:455) with an
`MHATokenToKVPoolHost` (mem_cache/pool_host/mha.py). On a CPU server it stops three times:
- host-pool allocation: `ALLOC_MEMORY_FUNCS` (pool_host/common.py:453) maps "cpu" to
  `alloc_with_host_register` (`:330`), which pins with `_cuda_host_register` (`:143`) through
  `torch.cuda.cudart()`: "Found no NVIDIA driver". CPU memory needs no registration, so in CPU mode
  without CUDA the register does nothing (`HostKVCache.destroy` unregisters only on cuda/hip, base.py:295).
- the `direct` io backend's ops (`transfer_kv_direct`, `transfer_kv_per_layer_direct_pf_lf`,
  `transfer_kv_all_layer_direct_lf_pf`) are imported only for cuda/hip (mha.py:60) or xpu (`:75`): the
  first backup raises NameError. `load_to_device_per_layer` and `backup_from_device_all_layer` with
  io_backend "direct" are answered here with index copies (layouts `layer_first` and
  `page_first_direct`); the `kernel` backend (pointer-table ops) is not, and the launcher refuses it
  on CPU.
- `torch.cpu.Stream` has no `synchronize` (l2_transfer.py:123 calls it when a transfer raised, which
  then hides the real error): the transfer engine's two streams get one that returns at once (CPU
  ops are synchronous).
A GPU server never gets these hooks (plugin.cpu_hooks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from vamp_sglang.integration.hooks import Hook

DIRECT = "direct"
_COMMON = "sglang.srt.mem_cache.pool_host.common"
_MHA_HOST = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
# Called with (tokens, seconds) once per load of every layer: the host tier's measured load rate
# (integration/cache/hicache_tier.py), calibrated from HiCache's own transfers.
LOAD_OBSERVERS: list[Callable[[int, float], None]] = []
_load_s = [0.0]  # seconds spent so far in the layers of the load in progress


def _host_register(original, buffer: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Around `_cuda_host_register`: nothing to register without CUDA."""
    if buffer.device.type == "cpu" and not torch.cuda.is_available():
        return None
    return original(buffer, *args, **kwargs)


def _rows(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.long)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int = 1) -> None:
    """Token-row copies `dst[dst_indices] = src[src_indices]`, one pair of layer tensors at a time."""
    src_rows, dst_rows = _rows(src_indices), _rows(dst_indices)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_rows] = src[src_rows].to(dst.dtype)


def _page_coords(host_indices: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows(host_indices)
    return rows // page_size, rows % page_size


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id: int,
                                       page_size: int) -> None:
    """Host page_first_direct `[page, layer, slot, head, dim]` -> one device layer `[token, head, dim]`."""
    pages, slots = _page_coords(src_indices, page_size)
    dst_rows = _rows(dst_indices)
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_rows] = src[pages, layer_id, slots].to(dst.dtype)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size: int) -> None:
    """Every device layer (all K layers, then all V layers) -> host page_first_direct K and V."""
    pages, slots = _page_coords(dst_indices, page_size)
    src_rows = _rows(src_indices)
    half = len(src_ptrs) // 2
    for side, dst in enumerate(dst_ptrs):
        for layer_id, src in enumerate(src_ptrs[side * half:(side + 1) * half]):
            dst[pages, layer_id, slots] = src[src_rows].to(dst.dtype)


def load_to_device_per_layer(original, host: Any, device_pool: Any, host_indices, device_indices, layer_id,
                             io_backend, *args: Any, **kwargs: Any) -> Any:
    """Around `MHATokenToKVPoolHost.load_to_device_per_layer`: the `direct` copies in torch."""
    if io_backend != DIRECT:
        return original(host, device_pool, host_indices, device_indices, layer_id, io_backend, *args, **kwargs)
    if not kwargs.get("is_draft", False) and not 0 <= layer_id < host.target_layer_num:
        return None
    start = time.perf_counter()
    _load_layer(host, host_indices, device_indices, layer_id)
    _load_s[0] = (0.0 if layer_id == 0 else _load_s[0]) + time.perf_counter() - start
    if layer_id == host.target_layer_num - 1:
        for observe in LOAD_OBSERVERS:
            observe(int(host_indices.numel()), _load_s[0])
    return None


def _load_layer(host: Any, host_indices, device_indices, layer_id: int) -> None:
    device = [host.device_k_buffers[layer_id], host.device_v_buffers[layer_id]]
    if host.layout == "layer_first":
        transfer_kv_direct([host.k_buffer[layer_id], host.v_buffer[layer_id]], device, host_indices, device_indices)
    elif host.layout == "page_first_direct":
        transfer_kv_per_layer_direct_pf_lf([host.k_buffer, host.v_buffer], device, host_indices, device_indices,
                                           layer_id, host.page_size)
    else:
        raise ValueError(f"Unsupported layout for the direct io backend on CPU: {host.layout}")


def backup_from_device_all_layer(original, host: Any, device_pool: Any, host_indices, device_indices,
                                 io_backend, *args: Any, **kwargs: Any) -> Any:
    """Around `MHATokenToKVPoolHost.backup_from_device_all_layer`: the `direct` copies in torch."""
    if io_backend != DIRECT:
        return original(host, device_pool, host_indices, device_indices, io_backend, *args, **kwargs)
    device = list(host.device_k_buffers) + list(host.device_v_buffers)
    if host.layout == "layer_first":
        transfer_kv_direct(device, host.host_kv_data_refs, device_indices, host_indices)
    elif host.layout == "page_first_direct":
        transfer_kv_all_layer_direct_lf_pf(device, [host.k_buffer, host.v_buffer], device_indices, host_indices,
                                           host.page_size)
    else:
        raise ValueError(f"Unsupported layout for the direct io backend on CPU: {host.layout}")
    return None


class SyncCpuStream(torch.cpu.Stream):
    """torch.cpu.Stream with the `synchronize` SGLang's transfer engine calls; CPU ops are synchronous."""

    def synchronize(self) -> None:
        return None


def _after_transfer_engine_init(result: Any, engine: Any, *args: Any, **kwargs: Any) -> None:
    """After `L2TransferEngine.__init__`: CPU streams that can be synchronized."""
    for name in ("device_to_host_stream", "host_to_device_stream"):
        stream = getattr(engine, name, None)
        if type(stream) is torch.cpu.Stream:
            setattr(engine, name, SyncCpuStream())


HOOKS = [
    Hook(f"{_COMMON}._cuda_host_register", "around", _host_register,
         "CPU mode: HiCache's host pool is plain CPU memory (no CUDA driver to register it with)"),
    Hook(f"{_MHA_HOST}.load_to_device_per_layer", "around", load_to_device_per_layer,
         "CPU mode: HiCache's direct io backend loads host KV with torch index copies (its ops are CUDA/XPU-only)"),
    Hook(f"{_MHA_HOST}.backup_from_device_all_layer", "around", backup_from_device_all_layer,
         "CPU mode: HiCache's direct io backend backs device KV up with torch index copies"),
    Hook("sglang.srt.mem_cache.l2_transfer.L2TransferEngine.__init__", "after", _after_transfer_engine_init,
         "CPU mode: HiCache's transfer streams get the synchronize torch.cpu.Stream lacks"),
]
