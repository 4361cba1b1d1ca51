"""Page backends: CUDA driver VMM semantics (reserve, create, map, unmap, release) over GPU or host memory.

Why one interface: the expert layout, KV growth and repartitioner (paper sections IV-C, IV-D) are written
once above it and tested on a CPU with real host pages. The rules the CUDA driver enforces are checked
here, in bookkeeping shared by both backends, so code that would fail on a GPU fails the same way on a
CPU: sizes and addresses are multiples of the granularity, maps go only into a reservation and only over
unmapped VA, an unmap covers exactly one whole mapping, a reservation is freed only when nothing is mapped
in it, and releasing a mapped handle defers the free until its last mapping is gone.

Backends hold one handle per `create` call; the layers above create one page per handle so any page can
move on its own. Subclasses implement only the raw `_..._raw` primitives; every public method here checks
the rules first and records the change only after the primitive succeeded, so a raising call leaves the
bookkeeping as it was.
"""

from __future__ import annotations

import abc
import bisect
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vamp_sglang.config import PAGE_BACKENDS

BACKEND_NAMES = PAGE_BACKENDS  # the one list of names, --vamp-page-backend's


class VmmRuleError(ValueError):
    """A call broke a CUDA VMM rule (alignment, range, overlap, whole-mapping unmap, handle state)."""


class BackendUnavailableError(RuntimeError):
    """The requested page backend cannot run on this machine (no driver, wrong device type, not Linux)."""


@dataclass(frozen=True, eq=False)
class PageHandle:
    """Physical pages from one `create` call. Compared by identity, like a CUDA allocation handle."""

    nbytes: int
    raw: Any  # the backend's own token: CUmemGenericAllocationHandle on CUDA, memfd byte offset on host


@dataclass(frozen=True)
class LiveCounts:
    """What a backend still holds; all zero after a clean teardown (leak checks)."""

    reservations: int
    mappings: int
    handles: int


class HostArena:
    """One host allocation of exactly `nbytes`, sliced per layer; 256-byte aligned slices keep copies fast.

    Why one arena: `torch.empty(pin_memory=True)` rounds every buffer up to a power of two (torch's
    caching host allocator), which for Qwen3-30B-A3B at ratio 0.5 pins about 36 GiB for 27 GiB of
    host copies per rank. A backend that must page-lock memory registers the arena's one plain
    allocation instead (`CudaPageBackend`), so `pinned_bytes` is exactly what the copies need."""

    ALIGN_BYTES = 256

    def __init__(self, nbytes: int, pinned_bytes: int = 0,
                 release: Callable[[], None] | None = None,
                 buffer: torch.Tensor | None = None) -> None:
        self.nbytes = nbytes
        self.pinned_bytes = pinned_bytes
        if buffer is None:
            raw = torch.empty(nbytes + self.ALIGN_BYTES, dtype=torch.uint8)
            skip = -raw.data_ptr() % self.ALIGN_BYTES
            buffer = raw[skip:skip + nbytes]
        self._buffer = buffer
        # `release` (the CUDA unregistration) runs once: at close(), or when the arena is collected
        # without one (a build that failed half-way), before its memory can be freed and reused
        self._release = weakref.finalize(self, release) if release is not None else None
        if self._release is not None:
            self._release.atexit = False  # process exit frees it all; the driver may be gone by then
        self._used = 0

    @staticmethod
    def bytes_for(sizes: Sequence[int]) -> int:
        """Arena size that holds slices of these sizes, each aligned."""
        align = HostArena.ALIGN_BYTES
        return sum(-(-n // align) * align for n in sizes)

    @property
    def buffer(self) -> torch.Tensor:
        return self._buffer

    @property
    def used_bytes(self) -> int:
        return self._used

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the arena, as a flat uint8 tensor."""
        if self._buffer is None:
            raise VmmRuleError("host arena is closed")
        start = self._used
        end = start + -(-nbytes // self.ALIGN_BYTES) * self.ALIGN_BYTES
        if end > self.nbytes:
            raise VmmRuleError(f"host arena: {nbytes} more bytes do not fit ({self._used} of {self.nbytes} used)")
        self._used = end
        return self._buffer[start:start + nbytes]

    def close(self) -> None:
        """Unregister (CUDA) and drop the memory; slices must not be used afterwards."""
        if self._release is not None:
            self._release()
        self._buffer = None


class PageBackend(abc.ABC):
    """Reserve / create / map / unmap / release with the CUDA rules checked in shared bookkeeping."""

    name: str
    device: torch.device
    granularity_bytes: int

    def __init__(self, device: torch.device, granularity_bytes: int) -> None:
        if granularity_bytes <= 0:
            raise VmmRuleError(f"granularity_bytes must be positive (got {granularity_bytes})")
        self.device = device
        self.granularity_bytes = granularity_bytes
        self._lock = threading.RLock()
        self._reservations: dict[int, int] = {}  # base -> nbytes
        self._reservation_bases: list[int] = []  # sorted
        self._mappings: dict[int, tuple[int, PageHandle]] = {}  # addr -> (nbytes, handle)
        self._mapping_addrs: list[int] = []  # sorted
        self._handle_mapping_counts: dict[PageHandle, int] = {}  # live handles -> number of mappings
        self._released: set[PageHandle] = set()  # released while mapped: freed at the last unmap
        self._closed = False

    # ---- public API -------------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> int:
        """Reserve `nbytes` of unbacked VA aligned to the granularity; returns its base address."""
        self._check_multiple("nbytes", nbytes)
        with self._lock:
            base = self._reserve_raw(nbytes)
            self._reservations[base] = nbytes
            bisect.insort(self._reservation_bases, base)
            return base

    def free_reservation(self, base: int, nbytes: int) -> None:
        """Give the VA back; refused unless (base, nbytes) is one whole reservation with nothing mapped."""
        with self._lock:
            if self._reservations.get(base) != nbytes:
                raise VmmRuleError(f"free_reservation({base:#x}, {nbytes}): not a whole reservation")
            if self._mapped_bytes_in(base, nbytes):
                raise VmmRuleError(f"free_reservation({base:#x}): pages are still mapped in it")
            self._free_reservation_raw(base, nbytes)
            del self._reservations[base]
            del self._reservation_bases[bisect.bisect_left(self._reservation_bases, base)]

    def create(self, nbytes: int) -> PageHandle:
        """Allocate and commit physical pages now, so a shortage raises MemoryError here."""
        self._check_multiple("nbytes", nbytes)
        with self._lock:
            handle = self._create_raw(nbytes)
            self._handle_mapping_counts[handle] = 0
            return handle

    def release(self, handle: PageHandle) -> None:
        """Drop the caller's reference; the pages are freed when the handle's last mapping goes."""
        with self._lock:
            self._check_live(handle)
            if self._handle_mapping_counts[handle] == 0:
                self._release_raw(handle)
                del self._handle_mapping_counts[handle]
            else:
                self._released.add(handle)

    def map(self, addr: int, handle: PageHandle) -> None:
        """Map the whole handle at `addr` (inside a reservation, over unmapped VA) and make it read-write."""
        self._check_multiple("addr", addr)
        with self._lock:
            self._check_live(handle)
            self._check_in_reservation(addr, handle.nbytes)
            if self._mapped_bytes_in(addr, handle.nbytes):
                raise VmmRuleError(f"map({addr:#x}, {handle.nbytes}): the range overlaps a live mapping")
            self._map_raw(addr, handle)
            self._mappings[addr] = (handle.nbytes, handle)
            bisect.insort(self._mapping_addrs, addr)
            self._handle_mapping_counts[handle] += 1

    def map_run(self, addr: int, handles: Sequence[PageHandle]) -> None:
        """Map `handles` back to back from `addr`, all or none; access is set once over the whole run
        (cuMemSetAccess over a contiguous range, issue 10 item 8). Each page stays its own mapping, so
        it can still be unmapped on its own."""
        self._check_multiple("addr", addr)
        handles = list(handles)
        total = sum(h.nbytes for h in handles)
        with self._lock:
            for handle in handles:
                self._check_live(handle)
            if len(set(handles)) != len(handles):
                raise VmmRuleError("map_run: a handle appears twice in one run")
            if not handles:
                return
            self._check_in_reservation(addr, total)
            if self._mapped_bytes_in(addr, total):
                raise VmmRuleError(f"map_run({addr:#x}, {total}): the range overlaps a live mapping")
            self._map_run_raw(addr, handles)
            for handle in handles:
                self._mappings[addr] = (handle.nbytes, handle)
                bisect.insort(self._mapping_addrs, addr)
                self._handle_mapping_counts[handle] += 1
                addr += handle.nbytes

    def unmap(self, addr: int, nbytes: int) -> None:
        """Unmap exactly one whole mapping (cuMemUnmap cannot split one).

        This does NOT synchronise: the caller must first make sure no queued kernel or copy can still
        touch the page (`synchronize()`). The Repartitioner synchronises once before a transaction and
        again before rolling one back; `close()` synchronises before it unmaps what is left."""
        with self._lock:
            entry = self._mappings.get(addr)
            if entry is None or entry[0] != nbytes:
                raise VmmRuleError(f"unmap({addr:#x}, {nbytes}): not exactly one whole mapping")
            handle = entry[1]
            self._unmap_raw(addr, nbytes)
            del self._mappings[addr]
            del self._mapping_addrs[bisect.bisect_left(self._mapping_addrs, addr)]
            self._handle_mapping_counts[handle] -= 1
            if self._handle_mapping_counts[handle] == 0 and handle in self._released:
                self._release_raw(handle)
                self._released.discard(handle)
                del self._handle_mapping_counts[handle]

    def tensor(self, addr: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A non-owning view of `nbytes` at `addr`. The range must lie in one reservation, mapped or not:
        an expert tensor spans its offloaded (unmapped) tail, and touching that tail faults."""
        shape = tuple(int(d) for d in shape)
        need_bytes = _numel(shape) * dtype.itemsize
        if need_bytes > nbytes:
            raise VmmRuleError(f"tensor shape {shape} of {dtype} needs {need_bytes} bytes > nbytes {nbytes}")
        with self._lock:
            self._check_in_reservation(addr, nbytes)
        storage = torch._C._construct_storage_from_data_pointer(addr, self.device, nbytes)
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, shape)

    def is_mapped(self, addr: int, nbytes: int) -> bool:
        """Whether every byte of [addr, addr + nbytes) is covered by live mappings."""
        with self._lock:
            return self._mapped_bytes_in(addr, nbytes) == nbytes

    def live_counts(self) -> LiveCounts:
        with self._lock:
            return LiveCounts(len(self._reservations), len(self._mappings), len(self._handle_mapping_counts))

    def close(self) -> None:
        """Synchronise, then unmap, free and release everything still held and drop the backend's own
        resources. Views into this backend's memory must not be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self.synchronize()
            for addr in list(self._mapping_addrs):
                self.unmap(addr, self._mappings[addr][0])
            for base in list(self._reservation_bases):
                self.free_reservation(base, self._reservations[base])
            for handle in list(self._handle_mapping_counts):
                self.release(handle)
            self._close_raw()
            self._closed = True

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all work that may touch mapped pages; call before unmapping live data."""

    @abc.abstractmethod
    def host_arena(self, nbytes: int) -> HostArena:
        """Exactly `nbytes` of host memory for copies to and from this backend's pages (page-locked on
        CUDA), handed out in slices; one arena holds every layer's host copy (issue 10 item 3)."""

    # ---- primitives each backend implements; each leaves the memory as it was if it raises ----------

    @abc.abstractmethod
    def _reserve_raw(self, nbytes: int) -> int: ...

    @abc.abstractmethod
    def _free_reservation_raw(self, base: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _create_raw(self, nbytes: int) -> PageHandle: ...

    @abc.abstractmethod
    def _release_raw(self, handle: PageHandle) -> None: ...

    def _map_raw(self, addr: int, handle: PageHandle) -> None:
        self._map_run_raw(addr, [handle])

    @abc.abstractmethod
    def _map_run_raw(self, addr: int, handles: list[PageHandle]) -> None:
        """Map consecutive pages and make them read-write, setting access once over the whole run;
        on failure unmap what this call mapped (`_unmap_range_raw`) and raise."""

    def _unmap_range_raw(self, addr: int, handles: list[PageHandle], nbytes: int) -> None:
        """Undo the first `nbytes` of a partly mapped run, one mapping at a time."""
        for handle in handles:
            if nbytes <= 0:
                return
            self._unmap_raw(addr, handle.nbytes)
            addr += handle.nbytes
            nbytes -= handle.nbytes

    @abc.abstractmethod
    def _unmap_raw(self, addr: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _close_raw(self) -> None: ...

    # ---- rule checks -----------------------------------------------------------------------------

    def _check_multiple(self, field: str, value: int) -> None:
        if value % self.granularity_bytes or (field == "nbytes" and value <= 0):
            raise VmmRuleError(
                f"{field}={value} must be a positive multiple of the granularity ({self.granularity_bytes})")

    def _check_live(self, handle: PageHandle) -> None:
        if handle not in self._handle_mapping_counts or handle in self._released:
            raise VmmRuleError(f"handle {handle.raw!r} is not a live handle of this backend")

    def _check_in_reservation(self, addr: int, nbytes: int) -> None:
        i = bisect.bisect_right(self._reservation_bases, addr) - 1
        if i < 0 or addr + nbytes > self._reservation_bases[i] + self._reservations[self._reservation_bases[i]]:
            raise VmmRuleError(f"range [{addr:#x}, +{nbytes}) is not inside one reservation")

    def _mapped_bytes_in(self, addr: int, nbytes: int) -> int:
        """Bytes of [addr, addr + nbytes) covered by live mappings."""
        end = addr + nbytes
        i = max(bisect.bisect_right(self._mapping_addrs, addr) - 1, 0)
        covered = 0
        while i < len(self._mapping_addrs) and self._mapping_addrs[i] < end:
            start = self._mapping_addrs[i]
            stop = start + self._mappings[start][0]
            covered += max(0, min(stop, end) - max(start, addr))
            i += 1
        return covered


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise VmmRuleError(f"tensor shape {shape} has a negative dimension")
        n *= d
    return n
