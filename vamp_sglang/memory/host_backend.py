"""Host page backend: memfd pages mapped at fixed addresses inside PROT_NONE reservations.

This is how a CPU machine runs the same remapping code as a GPU (see research/host-vmm.md for the
measurements). Each primitive mirrors a CUDA driver call:

    cuMemAddressReserve  mmap(NULL, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE), trimmed to align
    cuMemCreate          a range of one memfd, committed with fallocate so a shortage raises MemoryError now
                         instead of SIGBUS at first touch
    cuMemMap + SetAccess mmap(addr, RW, MAP_SHARED|MAP_FIXED, memfd, offset), then MADV_POPULATE_WRITE
                         (which reports failure, unlike MAP_POPULATE) once per contiguous run of pages;
                         on failure the placeholder returns
    cuMemUnmap           mmap(addr, PROT_NONE, MAP_FIXED anonymous): the VA is a placeholder again in one call,
                         with no munmap window in which another mmap could land there
    cuMemRelease         fallocate(PUNCH_HOLE) and the memfd range goes back on a free list

Python's `mmap` module cannot map at an address, so libc is called through ctypes. Linux only.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

import torch

from vamp_sglang.memory.backend import (
    BackendUnavailableError,
    HostArena,
    PageBackend,
    PageHandle,
    VmmRuleError,
)

DEFAULT_GRANULARITY_BYTES = 2 << 20  # the CUDA granularity on current GPUs; 4 KiB pages are 40x slower

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_PLACEHOLDER_FLAGS = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value


def _os_error(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call}: {os.strerror(err)}")


class _MemfdPool:
    """Byte ranges of one memfd handed out first-fit; freed ranges are hole-punched and reused."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._libc = libc
        self.fd = os.memfd_create("vamp-pages", os.MFD_CLOEXEC)
        self.size_bytes = 0
        self._free: list[tuple[int, int]] = []  # sorted (offset, nbytes), coalesced

    def take(self, nbytes: int) -> int:
        """Commit `nbytes` of physical memory and return its memfd offset."""
        offset = self._take_range(nbytes)
        try:
            os.posix_fallocate(self.fd, offset, nbytes)
        except OSError as exc:
            self.give_back(offset, nbytes)
            raise MemoryError(f"host page backend: cannot commit {nbytes} bytes: {exc.strerror}") from exc
        return offset

    def give_back(self, offset: int, nbytes: int) -> None:
        """Free the physical pages of a range and make the range reusable."""
        if self._libc.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes):
            raise _os_error("fallocate(PUNCH_HOLE)")
        self._free.append((offset, nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self._free = merged

    def close(self) -> None:
        os.close(self.fd)

    def _take_range(self, nbytes: int) -> int:
        for i, (off, n) in enumerate(self._free):
            if n >= nbytes:
                self._free[i:i + 1] = [(off + nbytes, n - nbytes)] if n > nbytes else []
                return off
        offset = self.size_bytes
        os.ftruncate(self.fd, offset + nbytes)
        self.size_bytes = offset + nbytes
        return offset


class HostPageBackend(PageBackend):
    """Real host pages with CUDA VMM rules; `populate` pre-faults mapped pages (faster overall, see note)."""

    name = "host"

    def __init__(self, device: torch.device | str = "cpu", granularity_bytes: int = DEFAULT_GRANULARITY_BYTES,
                 populate: bool = True) -> None:
        device = torch.device(device)
        if device.type != "cpu":
            raise BackendUnavailableError(f"host page backend serves device 'cpu' only (got {device})")
        if not sys.platform.startswith("linux"):
            raise BackendUnavailableError(f"host page backend needs Linux mmap/memfd (platform {sys.platform})")
        if granularity_bytes <= 0 or granularity_bytes % mmap.PAGESIZE:
            raise VmmRuleError(f"granularity_bytes={granularity_bytes} must be a positive multiple of the "
                               f"OS page size ({mmap.PAGESIZE})")
        super().__init__(device, granularity_bytes)
        self.populate = populate
        self._libc = _load_libc()
        self._pool = _MemfdPool(self._libc)

    def synchronize(self) -> None:
        """Host primitives are synchronous; copy threads above this layer must be joined by their owner."""

    def host_arena(self, nbytes: int) -> HostArena:
        """Plain host memory: nothing to page-lock for CPU copies."""
        return HostArena(nbytes)

    @property
    def committed_bytes(self) -> int:
        """Physical bytes held by the memfd (released pages are hole-punched and not counted)."""
        return os.fstat(self._pool.fd).st_blocks * 512

    def _reserve_raw(self, nbytes: int) -> int:
        gran = self.granularity_bytes
        raw = self._libc.mmap(None, nbytes + gran, _PROT_NONE, _PLACEHOLDER_FLAGS, -1, 0)
        if raw == _MAP_FAILED:
            raise _os_error("mmap(reserve)")
        base = -(-raw // gran) * gran
        self._munmap(raw, base - raw)  # trim so the reservation is aligned to the granularity
        self._munmap(base + nbytes, raw + nbytes + gran - (base + nbytes))
        return base

    def _free_reservation_raw(self, base: int, nbytes: int) -> None:
        self._munmap(base, nbytes)

    def _create_raw(self, nbytes: int) -> PageHandle:
        return PageHandle(nbytes=nbytes, raw=self._pool.take(nbytes))

    def _release_raw(self, handle: PageHandle) -> None:
        self._pool.give_back(handle.raw, handle.nbytes)

    def _map_run_raw(self, addr: int, handles: list[PageHandle]) -> None:
        """mmap each page, then build the page tables once over the run (as cuMemSetAccess is set once)."""
        done = 0
        try:
            for handle in handles:
                got = self._libc.mmap(addr + done, handle.nbytes, _PROT_RW, _MAP_SHARED | _MAP_FIXED,
                                      self._pool.fd, handle.raw)
                if got == _MAP_FAILED:
                    failure = _os_error("mmap(map)")
                    self._unmap_raw(addr + done, handle.nbytes)  # the placeholder may already be gone
                    raise failure
                done += handle.nbytes
            if self.populate:
                self._populate(addr, done)
        except BaseException:
            self._unmap_range_raw(addr, handles, done)
            raise

    def _populate(self, addr: int, nbytes: int) -> None:
        """Build the page tables now; the second half of a map, like cuMemSetAccess on CUDA."""
        if self._libc.madvise(addr, nbytes, _MADV_POPULATE_WRITE):
            err = ctypes.get_errno()
            hint = " (needs Linux >= 5.14; pass populate=False)" if err == errno.EINVAL else ""
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}{hint}")

    def _unmap_raw(self, addr: int, nbytes: int) -> None:
        got = self._libc.mmap(addr, nbytes, _PROT_NONE, _PLACEHOLDER_FLAGS | _MAP_FIXED, -1, 0)
        if got == _MAP_FAILED:
            raise _os_error("mmap(unmap placeholder)")

    def _close_raw(self) -> None:
        self._pool.close()

    def _munmap(self, addr: int, nbytes: int) -> None:
        if nbytes and self._libc.munmap(addr, nbytes):
            raise _os_error("munmap")
