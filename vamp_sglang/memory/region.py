"""PagedRegion: a reservation with an ordered run of mapped pages from its base, grown and shrunk at the tail.

The same structure serves both sides of the repartitioning (paper section IV-D): an expert tensor's
offloaded high-index groups are its tail pages, and a KV buffer grows by mapping those pages at its own
tail. Because the virtual range is reserved up front, addresses never move: `regrow` re-points the SAME
tensor object at a longer (or shorter) storage, so every holder of that object sees the new size.

Every method leaves the region as it was if it raises.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from vamp_sglang.memory.backend import PageBackend, PageHandle, VmmRuleError


class PagedRegion:
    """A reservation of `reserved_bytes` whose first `mapped_bytes` are mapped, page after page.

    With `base` the region is a sub-range of a reservation its caller owns (one layer's rows of a
    layer-strided state tensor, state_buffers.py) and `close` leaves that reservation alone."""

    def __init__(self, backend: PageBackend, reserved_bytes: int, base: int | None = None) -> None:
        self.backend = backend
        self.reserved_bytes = reserved_bytes
        self._owns_reservation = base is None
        self.base = backend.reserve(reserved_bytes) if base is None else base
        self._handles: list[PageHandle] = []
        self._mapped_bytes = 0
        self._closed = False

    @property
    def mapped_bytes(self) -> int:
        return self._mapped_bytes

    @property
    def handles(self) -> tuple[PageHandle, ...]:
        """The mapped pages in address order."""
        return tuple(self._handles)

    def append(self, handle: PageHandle) -> None:
        """Map `handle` right after the last mapped page."""
        self.extend([handle])

    def append_new_pages(self, count: int) -> None:
        """Create `count` one-granule pages and map them at the tail as one run; on failure they are released."""
        gran = self.backend.granularity_bytes
        handles: list[PageHandle] = []
        try:
            for _ in range(count):
                handles.append(self.backend.create(gran))
            self.extend(handles)
        except BaseException:
            for handle in handles:
                self.backend.release(handle)
            raise

    def extend(self, handles: Sequence[PageHandle]) -> None:
        """Append several pages as one run (access set once, issue 10 item 8), all or none."""
        handles = list(handles)
        total = sum(h.nbytes for h in handles)
        self._check_open()
        if self._mapped_bytes + total > self.reserved_bytes:
            raise VmmRuleError(f"extend: {self._mapped_bytes} + {total} bytes exceed the region's "
                               f"reserved_bytes {self.reserved_bytes}")
        self.backend.map_run(self.base + self._mapped_bytes, handles)
        self._handles.extend(handles)
        self._mapped_bytes += total

    def pop_tail(self) -> PageHandle:
        """Unmap the last page and return its handle (still live, for reuse or release).
        Work that may touch the page must be finished first (`backend.synchronize()`)."""
        self._check_open()
        if not self._handles:
            raise VmmRuleError("pop_tail: the region has no mapped pages")
        handle = self._handles[-1]
        self.backend.unmap(self.base + self._mapped_bytes - handle.nbytes, handle.nbytes)
        self._handles.pop()
        self._mapped_bytes -= handle.nbytes
        return handle

    def view(self, dtype: torch.dtype, shape: Sequence[int], offset_bytes: int = 0) -> torch.Tensor:
        """A non-owning tensor at base + offset_bytes. It may reach past the mapped pages (an expert
        tensor spans its offloaded tail); touching unmapped bytes faults."""
        self._check_open()
        return self.backend.tensor(self.base + offset_bytes, self.reserved_bytes - offset_bytes, dtype, shape)

    def regrow(self, tensor: torch.Tensor, new_shape: Sequence[int]) -> None:
        """Re-point `tensor` (a view starting at this region's base) at `new_shape`, in place."""
        self._check_open()
        start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
        if start != self.base:  # tensor.data_ptr() reads 0 for an empty tensor, its storage does not
            raise VmmRuleError(f"regrow: tensor starts at {start:#x}, not at the region base {self.base:#x}")
        fresh = self.view(tensor.dtype, new_shape)
        tensor.set_(fresh.untyped_storage(), 0, fresh.shape)

    def fill_from(self, src: torch.Tensor, offset_bytes: int = 0) -> None:
        """Copy the bytes of contiguous `src` into mapped memory at base + offset_bytes."""
        nbytes = src.numel() * src.element_size()
        self._check_mapped(offset_bytes, nbytes, "fill_from")
        dst = self.view(torch.uint8, (nbytes,), offset_bytes)
        dst.copy_(src.contiguous().view(-1).view(torch.uint8))

    def page_checksums(self) -> list[int]:
        """CRC32 of every mapped page, in address order (integrity checks across remaps)."""
        sums: list[int] = []
        offset = 0
        for handle in self._handles:
            sums.append(bytes_checksum(self.view(torch.uint8, (handle.nbytes,), offset)))
            offset += handle.nbytes
        return sums

    def close(self) -> list[PageHandle]:
        """Unmap every page and free the reservation (if it is the region's own); returns the (still
        live) handles, head first."""
        if self._closed:
            return []
        self.backend.synchronize()
        popped: list[PageHandle] = []
        while self._handles:
            popped.append(self.pop_tail())
        if self._owns_reservation:
            self.backend.free_reservation(self.base, self.reserved_bytes)
        self._closed = True
        return popped[::-1]

    def _check_open(self) -> None:
        if self._closed:
            raise VmmRuleError("the region is closed")

    def _check_mapped(self, offset_bytes: int, nbytes: int, what: str) -> None:
        if offset_bytes < 0 or offset_bytes + nbytes > self._mapped_bytes:
            raise VmmRuleError(f"{what}: bytes [{offset_bytes}, {offset_bytes + nbytes}) are not all mapped "
                               f"(mapped_bytes={self._mapped_bytes})")


def bytes_checksum(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (copied to the host first if it lives on a GPU)."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu()
    return zlib.crc32(flat.numpy())
