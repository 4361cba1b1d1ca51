"""Linear-attention state tensors `[layers, rows, *slot]` whose every layer grows in place at its tail.

Paper IV-C on a hybrid model (Qwen3-Next): reclaimed expert pages may join the state pool as well as
the KV pool. SGLang's `MambaPool` keeps each kind of state (a conv window, the SSM state) as ONE
tensor indexed `[layer, slot]`, so a new slot is not at the tail of the tensor's memory but at the
tail of every layer's slot range. Here each kind is one reservation with a fixed layer stride, sized
for the most rows the offload bound allows; layer l's rows are a PagedRegion at base + l * stride,
and growing maps pages at every layer's tail. The tensor is the strided view `[layers, rows, *slot]`,
re-pointed in place (`Tensor.set_`), so every holder of the object sees the new rows at unchanged
addresses, and one layer's slice stays contiguous (the per-layer view SGLang's kernels index).

A row is one slot, SGLang's padding slot 0 included. Kinds hold different bytes per slot, so each
layer of each kind maps just the pages its rows need: `pages_for(rows)` is what holding `rows` costs
in pages, `rows_for_pages(pages)` the most rows that many pages hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vamp_sglang.memory.backend import PageBackend, PageHandle, VmmRuleError
from vamp_sglang.memory.journal import Journal, atomic
from vamp_sglang.memory.layout import pages_for_rows
from vamp_sglang.memory.region import PagedRegion, bytes_checksum


@dataclass(frozen=True)
class StateKind:
    """One state tensor of the pool: the shape and dtype of one slot of one layer."""

    slot_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def slot_elems(self) -> int:
        n = 1
        for d in self.slot_shape:
            n *= int(d)
        return n

    @property
    def slot_bytes(self) -> int:
        return self.slot_elems * self.dtype.itemsize


def pages_for(kinds: Sequence[StateKind], layers: int, granularity_bytes: int, rows: int) -> int:
    """Pages all kinds and layers map to hold `rows` rows."""
    return layers * sum(_unit_pages(k, rows, granularity_bytes) for k in kinds)


def rows_for_pages(kinds: Sequence[StateKind], layers: int, granularity_bytes: int, pages: int, most: int) -> int:
    """The most rows, at most `most`, that `pages` pages in all hold; 0 if not even one."""
    low, high = 0, most
    while low < high:
        mid = (low + high + 1) // 2
        if pages_for(kinds, layers, granularity_bytes, mid) <= pages:
            low = mid
        else:
            high = mid - 1
    return low


def _unit_pages(kind: StateKind, rows: int, granularity_bytes: int) -> int:
    """Pages one layer of one kind maps for `rows` rows."""
    return pages_for_rows(rows, kind.slot_bytes, granularity_bytes, 1) if rows else 0


class GrowableStateBuffers:
    """`tensors[k]` is kind k as `[layers, rows, *slot_shape]`; every layer's rows grow and shrink together."""

    def __init__(self, backend: PageBackend, kinds: Sequence[StateKind], layers: int, initial_rows: int,
                 max_rows: int) -> None:
        if not kinds:
            raise ValueError("kinds must name at least one state tensor")
        for name, value in (("layers", layers), ("initial_rows", initial_rows)):
            if value <= 0:
                raise ValueError(f"{name} must be positive (got {value})")
        if max_rows < initial_rows:
            raise ValueError(f"max_rows {max_rows} must be >= initial_rows {initial_rows}")
        if any(k.slot_bytes <= 0 for k in kinds):
            raise ValueError("every state kind needs a non-empty slot")
        self.backend, self.kinds, self.layers, self.max_rows = backend, tuple(kinds), layers, max_rows
        gran = backend.granularity_bytes
        self._stride_bytes = [pages_for_rows(max_rows, k.slot_bytes, gran, 1) * gran for k in self.kinds]
        self._reservations: list[tuple[int, int]] = []
        self._regions: list[list[PagedRegion]] = []  # [kind][layer]
        try:
            for kind, stride in zip(self.kinds, self._stride_bytes):
                base = backend.reserve(layers * stride)
                self._reservations.append((base, layers * stride))
                regions = [PagedRegion(backend, stride, base + layer * stride) for layer in range(layers)]
                self._regions.append(regions)
                for region in regions:
                    region.append_new_pages(self._unit_pages(kind, initial_rows))
        except BaseException:
            self.close()
            raise
        self.rows = initial_rows
        self.tensors = [torch.empty(0, dtype=k.dtype, device=backend.device) for k in self.kinds]
        for k, tensor in enumerate(self.tensors):
            self.view_into(tensor, k, initial_rows)

    def pages_for(self, rows: int) -> int:
        """Pages all kinds and layers map to hold `rows` rows."""
        return pages_for(self.kinds, self.layers, self.backend.granularity_bytes, rows)

    def rows_for_pages(self, pages: int) -> int:
        """The most rows (at most max_rows) that `pages` pages in all hold; 0 if not even one."""
        return rows_for_pages(self.kinds, self.layers, self.backend.granularity_bytes, pages, self.max_rows)

    def view_into(self, tensor: torch.Tensor, kind: int, rows: int) -> None:
        """Point `tensor` (ours or SGLang's) at the first `rows` rows of every layer of kind `kind`, in place."""
        if not 0 < rows <= self.max_rows:
            raise VmmRuleError(f"view_into: rows must be in [1, {self.max_rows}] (got {rows})")
        k = self.kinds[kind]
        base, nbytes = self._reservations[kind]
        flat = self.backend.tensor(base, nbytes, k.dtype, (nbytes // k.dtype.itemsize,))
        inner = torch.empty(k.slot_shape, dtype=k.dtype, device="meta").stride()
        stride = (self._stride_bytes[kind] // k.dtype.itemsize, k.slot_elems, *inner)
        tensor.set_(flat.untyped_storage(), 0, (self.layers, rows, *k.slot_shape), stride)

    def grow_to(self, rows: int, handles: Sequence[PageHandle], journal: Journal | None = None) -> None:
        """Map `handles` (exactly pages_for(rows) - pages_for(self.rows), kind by kind, layer by layer)
        at every layer's tail and re-point the tensors at `rows` rows. New rows hold whatever the pages
        held: SGLang clears a state slot when it hands it out."""
        need = [self._unit_pages(k, rows) - self._unit_pages(k, self.rows) for k in self.kinds]
        if rows < self.rows or rows > self.max_rows or any(n < 0 for n in need):
            raise VmmRuleError(f"grow_to: rows must be in [{self.rows}, {self.max_rows}] (got {rows})")
        if len(handles) != self.layers * sum(need):
            raise VmmRuleError(f"grow_to {rows} rows takes {self.layers * sum(need)} pages (got {len(handles)})")
        with atomic(journal, on_failure=self.backend.synchronize) as j:
            at = 0
            for kind, per_layer in enumerate(need):
                for region in self._regions[kind]:
                    j.run(lambda r=region, hs=handles[at:at + per_layer]: r.extend(hs),
                          lambda _, r=region, n=per_layer: [r.pop_tail() for _ in range(n)])
                    at += per_layer
            self._set_rows(rows, j)

    def shrink_to(self, rows: int, journal: Journal | None = None) -> list[PageHandle]:
        """Unmap the pages rows past `rows` no longer need and return them (live), in grow_to's order.
        The caller confirms those rows are free slots first."""
        if not 0 < rows <= self.rows:
            raise VmmRuleError(f"shrink_to: rows must be in [1, {self.rows}] (got {rows})")
        if journal is None:  # inside a transaction its owner synchronises once
            self.backend.synchronize()
        out: list[PageHandle] = []
        with atomic(journal, on_failure=self.backend.synchronize) as j:
            self._set_rows(rows, j)
            for kind, k in enumerate(self.kinds):
                drop = len(self._regions[kind][0].handles) - self._unit_pages(k, rows)
                for region in self._regions[kind]:
                    popped = [j.run(region.pop_tail, region.append) for _ in range(drop)]
                    out.extend(popped[::-1])
        return out

    def checksums(self, rows: int | None = None) -> list[int]:
        """CRC32 of rows [0, rows) of every layer of every kind (integrity across remaps)."""
        end = self.rows if rows is None else rows
        return [bytes_checksum(t[layer, :end]) for t in self.tensors for layer in range(self.layers)]

    def close(self) -> None:
        """Unmap and release every page and free the reservations; the tensors must not be used afterwards."""
        for regions in self._regions:
            for region in regions:
                for handle in region.close():
                    self.backend.release(handle)
        for base, nbytes in self._reservations:
            self.backend.free_reservation(base, nbytes)
        self._regions, self._reservations = [], []

    def _unit_pages(self, kind: StateKind, rows: int) -> int:
        return _unit_pages(kind, rows, self.backend.granularity_bytes)

    def _set_rows(self, rows: int, journal: Journal) -> None:
        old = self.rows
        for k, tensor in enumerate(self.tensors):
            self.view_into(tensor, k, rows)
        self.rows = rows
        journal.record(lambda: self._restore_rows(old))

    def _restore_rows(self, rows: int) -> None:
        for k, tensor in enumerate(self.tensors):
            self.view_into(tensor, k, rows)
        self.rows = rows
