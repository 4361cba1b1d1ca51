"""Per-layer K and V buffers (or MLA's one latent buffer) over reserved ranges that grow and shrink in place
at their tail.

Paper IV-C / V-A: reclaimed expert pages join the KV pool. Each buffer is a PagedRegion reserved for the
largest pool the offload bound allows; growing maps pages at its tail and re-points the SAME tensor
objects at the longer storage (`Tensor.set_`), so every holder (SGLang's `k_buffer[l]` lists, pointer
tables built from `data_ptr`) sees the new rows at unchanged addresses.

An MHA pool has two buffers per layer (K, V); an MLA pool (SGLang's `MLATokenToKVPool`) one, whose row is
`kv_lora_rank + qk_rope_head_dim` values of one head (`buffers_per_layer=1`, heads 1).
Every buffer holds the same number of pages, so every layer has one token capacity. A page need not
hold a whole number of rows (a row is heads * head_dim * itemsize bytes of one token in one layer), so
capacity is `floor(mapped_bytes / row_bytes)`, rounded down to `row_multiple` (the allocator's page size
in tokens); the initial and maximum capacities are at least the rows asked for. Shrinking is allowed
only over rows the caller confirms are free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vamp_sglang.memory.backend import PageBackend, PageHandle, VmmRuleError
from vamp_sglang.memory.journal import Journal, atomic
from vamp_sglang.memory.layout import ExpertLayout, kv_pages_per_buffer, kv_rows_for_bytes, pages_for_rows
from vamp_sglang.memory.region import PagedRegion, bytes_checksum


class KVShrinkError(RuntimeError):
    """Shrinking would drop rows that are still in use."""


class GrowableKVBuffers:
    """`k_buffers[l]` and `v_buffers[l]` (or, with one buffer per layer, `buffers[l]`), each
    `[rows, heads, head_dim]`, growable in place."""

    def __init__(self, backend: PageBackend, layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                 initial_rows: int, max_rows: int, row_multiple: int = 1, buffers_per_layer: int = 2) -> None:
        for name, value in (("layers", layers), ("heads", heads), ("head_dim", head_dim),
                            ("initial_rows", initial_rows), ("row_multiple", row_multiple)):
            if value <= 0:
                raise ValueError(f"{name} must be positive (got {value})")
        if max_rows < initial_rows:
            raise ValueError(f"max_rows {max_rows} must be >= initial_rows {initial_rows}")
        if buffers_per_layer not in (1, 2):
            raise ValueError(f"buffers_per_layer must be 1 (MLA) or 2 (K and V), got {buffers_per_layer}")
        self.buffers_per_layer = buffers_per_layer
        self.backend = backend
        self.heads, self.head_dim, self.dtype = heads, head_dim, dtype
        self.row_bytes = heads * head_dim * dtype.itemsize
        self.row_multiple = row_multiple
        gran = backend.granularity_bytes
        self.max_pages_per_buffer = pages_for_rows(max_rows, self.row_bytes, gran, row_multiple)
        initial_pages = pages_for_rows(initial_rows, self.row_bytes, gran, row_multiple)
        self._regions: list[PagedRegion] = []
        try:
            for _ in range(buffers_per_layer * layers):
                region = PagedRegion(backend, self.max_pages_per_buffer * gran)
                self._regions.append(region)
                region.append_new_pages(initial_pages)
        except BaseException:
            self.close()
            raise
        rows = self.rows_for_pages(initial_pages)
        self._buffers = [r.view(dtype, (rows, heads, head_dim)) for r in self._regions]

    @classmethod
    def for_layout(cls, backend: PageBackend, layout: ExpertLayout, layers: int, heads: int, head_dim: int,
                   dtype: torch.dtype, initial_rows: int, row_multiple: int = 1,
                   buffers_per_layer: int = 2) -> GrowableKVBuffers:
        """Buffers whose reservation holds the pool at the layout's offload bound (paper IV-C): the freed
        pages split over buffers_per_layer * layers buffers, so MLA's one buffer per layer gets twice the pages
        an MHA buffer would."""
        gran = backend.granularity_bytes
        row_bytes = heads * head_dim * dtype.itemsize
        pages = pages_for_rows(initial_rows, row_bytes, gran, row_multiple) + kv_pages_per_buffer(
            layout.bound_groups, layout.pages_freed_per_group, buffers_per_layer * layers)
        max_rows = kv_rows_for_bytes(pages * gran, row_bytes, row_multiple)
        return cls(backend, layers, heads, head_dim, dtype, initial_rows, max_rows, row_multiple, buffers_per_layer)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer, layer-major (K, V of layer 0, then layer 1, ...; or one latent buffer per layer)."""
        return list(self._buffers)

    @property
    def k_buffers(self) -> list[torch.Tensor]:
        self._need_k_and_v()
        return self._buffers[0::2]

    @property
    def v_buffers(self) -> list[torch.Tensor]:
        self._need_k_and_v()
        return self._buffers[1::2]

    def _need_k_and_v(self) -> None:
        if self.buffers_per_layer != 2:
            raise AttributeError("these buffers hold one latent per layer (MLA): use .buffers")

    @property
    def n_buffers(self) -> int:
        return len(self._regions)

    @property
    def pages_per_buffer(self) -> int:
        return self._regions[0].mapped_bytes // self.backend.granularity_bytes

    @property
    def row_capacity(self) -> int:
        """Rows every K and V buffer holds now."""
        return self._buffers[0].shape[0]

    @property
    def max_row_capacity(self) -> int:
        return self.rows_for_pages(self.max_pages_per_buffer)

    def rows_for_pages(self, pages_per_buffer: int) -> int:
        return kv_rows_for_bytes(pages_per_buffer * self.backend.granularity_bytes, self.row_bytes,
                                 self.row_multiple)

    def grow(self, handles: Sequence[PageHandle], journal: Journal | None = None) -> int:
        """Map `handles` at the tails (the same count per buffer) and regrow every tensor in place;
        returns the new token capacity. New rows hold whatever the pages held: they are free slots."""
        per_buffer, rest = divmod(len(handles), self.n_buffers)
        if rest:
            raise VmmRuleError(f"grow: {len(handles)} pages do not split evenly over {self.n_buffers} buffers")
        if self.pages_per_buffer + per_buffer > self.max_pages_per_buffer:
            raise VmmRuleError(f"grow: {self.pages_per_buffer} + {per_buffer} pages per buffer exceed the "
                               f"reservation of {self.max_pages_per_buffer} (raise max_rows)")
        with atomic(journal) as j:
            for b, region in enumerate(self._regions):  # one run per buffer: access set once (issue 10)
                j.run(lambda r=region, hs=handles[b::self.n_buffers]: r.extend(hs),
                      lambda _, r=region: [r.pop_tail() for _ in range(per_buffer)])
            self._regrow(self.rows_for_pages(self.pages_per_buffer), j)
        return self.row_capacity

    def shrink(self, n_pages: int, tail_is_free: Callable[[int, int], bool],
               journal: Journal | None = None) -> list[PageHandle]:
        """Unmap `n_pages` from every buffer's tail and return them (buffer-interleaved, live).
        `tail_is_free(first_row, end_row)` must confirm the dropped rows hold no live tokens."""
        if not 0 <= n_pages <= self.pages_per_buffer:
            raise VmmRuleError(f"shrink: n_pages must be in [0, {self.pages_per_buffer}] (got {n_pages})")
        new_rows = self.rows_for_pages(self.pages_per_buffer - n_pages)
        if not tail_is_free(new_rows, self.row_capacity):
            raise KVShrinkError(f"shrink: rows [{new_rows}, {self.row_capacity}) are not all free")
        if journal is None:  # inside a transaction its owner synchronises once
            self.backend.synchronize()
        with atomic(journal, on_failure=self.backend.synchronize) as j:
            self._regrow(new_rows, j)
            popped = [[j.run(r.pop_tail, r.append) for _ in range(n_pages)] for r in self._regions]
        return [popped[b][p] for p in range(n_pages) for b in range(self.n_buffers)]

    def checksums(self, end_row: int | None = None) -> list[int]:
        """CRC32 of rows [0, end_row) of every buffer (integrity across remaps)."""
        end = self.row_capacity if end_row is None else end_row
        return [bytes_checksum(t[:end]) for t in self._buffers]

    def close(self) -> None:
        """Unmap and release every page; the tensors must not be used afterwards."""
        for region in self._regions:
            for handle in region.close():
                self.backend.release(handle)
        self._regions = []

    def _regrow(self, rows: int, journal: Journal) -> None:
        old_rows = self.row_capacity
        shape = (rows, self.heads, self.head_dim)
        for region, tensor in zip(self._regions, self._buffers):
            region.regrow(tensor, shape)
        journal.record(lambda: [region.regrow(t, (old_rows, self.heads, self.head_dim))
                                for region, t in zip(self._regions, self._buffers)])
