"""CUDA page backend: the driver's virtual memory management through cuda-python.

One handle per page (cuMemCreate), mapped into reservations (cuMemAddressReserve) with cuMemMap, access
set with cuMemSetAccess once per contiguous run of pages, unmapped one whole mapping at a time
(cuMemUnmap), freed with cuMemRelease. Host copies live in one arena page-locked with cuMemHostRegister. The rules are
checked above, in `PageBackend`; the driver checks them again.

Allocations request no shareable handle type: each TP rank remaps only its own GPU's pages, so nothing is
exported. SGLang's `utils/cuda_vmm_utils.py` has equivalent helpers, but the memory layer must not import
SGLang (it pulls in torch.distributed and takes seconds), so the few lines are written here.

A machine without the driver library makes every cuda-python call RAISE (DynamicLibNotFoundError, a
RuntimeError) instead of returning a CUresult; the constructor turns that into BackendUnavailableError.
"""

from __future__ import annotations

import functools
import mmap
from typing import Any

import torch

from vamp_sglang.memory.backend import (
    BackendUnavailableError,
    HostArena,
    PageBackend,
    PageHandle,
    VmmRuleError,
)

_HOST_PAGE_BYTES = 4096  # cuMemHostRegister page-locks whole OS pages


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error code; the message names the call and the code."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailableError(f"cuda page backend needs cuda-python (cuda.bindings): {exc}") from exc
    return driver


def _check(drv: Any, result: tuple, call: str) -> Any:
    """Return the value of a driver call `(CUresult, value...)`, raising on an error code."""
    err = result[0]
    if err == drv.CUresult.CUDA_SUCCESS:
        return result[1] if len(result) > 1 else None
    if err == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
        raise MemoryError(f"{call}: CUDA_ERROR_OUT_OF_MEMORY")
    raise CudaDriverError(f"{call}: {err!r}")


def page_aligned_host_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh host memory (an anonymous mapping) as a uint8 tensor whose storage starts at the
    page boundary where the registration starts: torch's `is_pinned()` asks the driver about the
    storage's first byte, so an arena carved from a larger malloc'd block reads as not pinned (the first
    H200 run). The tensor keeps the mapping alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # private: Python's default for an anonymous mapping is MAP_SHARED, which is shmem (and shared with forks)
    mapping = mmap.mmap(-1, -(-nbytes // _HOST_PAGE_BYTES) * _HOST_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]


def _unregister_host(drv: Any, ctx: Any, base: int) -> None:
    _check(drv, drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _check(drv, drv.cuMemHostUnregister(base), "cuMemHostUnregister")


def _init_driver(drv: Any) -> None:
    """cuInit, turning 'no driver library' (raised) and 'no device' (returned) into BackendUnavailableError."""
    try:
        (err,) = drv.cuInit(0)
    except RuntimeError as exc:  # DynamicLibNotFoundError: libcuda.so is not installed
        raise BackendUnavailableError(f"cuda page backend: no NVIDIA driver library on this machine ({exc})") from exc
    if err != drv.CUresult.CUDA_SUCCESS:
        raise BackendUnavailableError(f"cuda page backend: cuInit failed with {err!r} (no usable GPU)")


def _open_device(drv: Any, index: int) -> Any:
    """cuDeviceGet for a present device that supports virtual memory management."""
    err, count = drv.cuDeviceGetCount()
    if err != drv.CUresult.CUDA_SUCCESS or index >= count:
        raise BackendUnavailableError(f"cuda page backend: device index {index} not present ({count} devices)")
    dev = _check(drv, drv.cuDeviceGet(index), "cuDeviceGet")
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    if not _check(drv, drv.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute(VMM)"):
        raise BackendUnavailableError(f"cuda page backend: device {index} does not support virtual memory management")
    return dev


class CudaPageBackend(PageBackend):
    """GPU pages through cuMem*; granularity defaults to the device's minimum (2 MiB on current GPUs)."""

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda", granularity_bytes: int | None = None) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailableError(f"cuda page backend serves CUDA devices only (got {device})")
        drv = _driver()
        _init_driver(drv)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._drv = drv
        self._dev = _open_device(drv, index)
        self._ctx = _check(drv, drv.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        self._prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        minimum_bytes = int(_check(drv, drv.cuMemGetAllocationGranularity(self._prop, flag), "granularity"))
        granularity_bytes = granularity_bytes or minimum_bytes
        if granularity_bytes % minimum_bytes:
            raise VmmRuleError(f"granularity_bytes={granularity_bytes} must be a multiple of the device "
                               f"minimum ({minimum_bytes})")
        super().__init__(torch.device("cuda", index), granularity_bytes)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def host_arena(self, nbytes: int) -> HostArena:
        """Host memory page-locked with cuMemHostRegister over exactly its page-rounded `nbytes` (torch's
        pinned allocator would round to a power of two; issue 10 item 3). PORTABLE: the copies may be
        issued from any context; DEVICEMAP: kernels may read it through its device pointer (the routed
        gather, issue 12). The registration ends at `close()`, or when the arena is collected without
        one, while the memory is still mapped: memory freed still registered leaves the range in the
        driver's table, and the next allocation at that address fails to register (712)."""
        buffer = page_aligned_host_buffer(nbytes)
        locked = -(-nbytes // _HOST_PAGE_BYTES) * _HOST_PAGE_BYTES
        if not locked:
            return HostArena(nbytes, buffer=buffer)
        base = buffer.data_ptr()
        self._current()
        flags = self._drv.CU_MEMHOSTREGISTER_PORTABLE | self._drv.CU_MEMHOSTREGISTER_DEVICEMAP
        self._call(self._drv.cuMemHostRegister(base, locked, flags), "cuMemHostRegister")
        return HostArena(nbytes, pinned_bytes=locked, buffer=buffer,
                         release=functools.partial(_unregister_host, self._drv, self._ctx, base))

    def _call(self, result: tuple, call: str) -> Any:
        return _check(self._drv, result, call)

    def _current(self) -> None:
        """Driver calls act on the calling thread's context; make it this device's primary context."""
        self._call(self._drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def _reserve_raw(self, nbytes: int) -> int:
        self._current()
        return int(self._call(self._drv.cuMemAddressReserve(nbytes, self.granularity_bytes, 0, 0),
                              "cuMemAddressReserve"))

    def _free_reservation_raw(self, base: int, nbytes: int) -> None:
        self._current()
        self._call(self._drv.cuMemAddressFree(base, nbytes), "cuMemAddressFree")

    def _create_raw(self, nbytes: int) -> PageHandle:
        self._current()
        return PageHandle(nbytes=nbytes, raw=self._call(self._drv.cuMemCreate(nbytes, self._prop, 0), "cuMemCreate"))

    def _release_raw(self, handle: PageHandle) -> None:
        self._current()
        self._call(self._drv.cuMemRelease(handle.raw), "cuMemRelease")

    def _map_run_raw(self, addr: int, handles: list[PageHandle]) -> None:
        """cuMemMap each page, then ONE cuMemSetAccess over the run: the driver allows access to be set
        over any fully mapped range, so a run costs one access call instead of one per page (issue 10 item 8)."""
        self._current()
        done = 0
        try:
            for handle in handles:
                self._call(self._drv.cuMemMap(addr + done, handle.nbytes, 0, handle.raw, 0), "cuMemMap")
                done += handle.nbytes
            self._call(self._drv.cuMemSetAccess(addr, done, self._access, 1), "cuMemSetAccess(run)")
        except BaseException:
            self._unmap_range_raw(addr, handles, done)
            raise

    def _unmap_raw(self, addr: int, nbytes: int) -> None:
        self._current()
        self._call(self._drv.cuMemUnmap(addr, nbytes), "cuMemUnmap")

    def _close_raw(self) -> None:
        self._call(self._drv.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")
