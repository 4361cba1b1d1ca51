"""One MoE layer's expert weights rebuilt over reserved virtual ranges, so their tail pages can leave.

Paper IV-C: offloading unmaps the physical pages behind a layer's highest-index expert groups and hands
them to the KV pool, while the expert tensor's virtual range stays reserved, so resident experts keep
their addresses. Paper V-B: the offloaded experts are then read from a staging buffer, filled from a
host copy made once at start.

Design chosen (aliasing): the offloaded virtual range is not left empty. Each offloaded page is mapped
onto the matching page of this layer's staging slot (slot = eligible-layer parity), so the tensor
`w13[E, 2I, H]` / `w2[E, H, I]` keeps ONE fixed address for every expert: resident experts read their
own pages, offloaded experts read the staging pages, and the MoE kernel (or a captured CUDA graph) runs
unchanged. Staging slot page s backs region page (routed_end_page - bound_pages + s) in every layer of
that parity, so the index arithmetic of a slot and of the host copy is the same.

Groups are counted from the top of the routed experts (layout.py), so a region may start with a pad:
the tensor begins at `base + pad_bytes` and the end of its routed experts is page aligned. Fused shared
experts (SGLang's, stored after the routed ones) sit on pages of their own above that end, which never
leave. No SGLang import: the glue passes plain tensors and
assigns `store.w13` / `store.w2` to the layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vamp_sglang.memory.backend import HostArena, PageBackend, PageHandle, VmmRuleError
from vamp_sglang.memory.journal import Journal, atomic
from vamp_sglang.memory.layout import ExpertLayout, LayoutError
from vamp_sglang.memory.region import bytes_checksum


class PagedWeight:
    """One expert weight `[E, *shard_shape]` over a reservation, one page per handle."""

    def __init__(self, backend: PageBackend, original: torch.Tensor, group_pages: int, bound_groups: int,
                 alias_pages: Sequence[PageHandle], host_arena: HostArena, routed_experts: int) -> None:
        """The offloadable pages end where the first `routed_experts` rows end; the rows above them
        (fused shared experts) get pages of their own that stay mapped."""
        gran = backend.granularity_bytes
        experts = original.shape[0]
        self.backend = backend
        self.shard_bytes = original[0].numel() * original.element_size()
        self.routed_experts = routed_experts
        self.routed_end_page = -(-routed_experts * self.shard_bytes // gran)
        self.pad_bytes = self.routed_end_page * gran - routed_experts * self.shard_bytes
        self.pages = self.routed_end_page + -(-(experts - routed_experts) * self.shard_bytes // gran)
        self.group_pages = group_pages
        self.bound_pages = bound_groups * group_pages
        if len(alias_pages) != self.bound_pages:
            raise LayoutError(f"alias_pages has {len(alias_pages)} pages, the offloadable tail needs "
                              f"{self.bound_pages}")
        self._alias = tuple(alias_pages)
        self.base = backend.reserve(self.pages * gran)
        self._own: list[PageHandle | None] = []  # the layer's own page at each index; None while offloaded
        try:
            with atomic(None) as journal:
                journal.record(lambda: backend.free_reservation(self.base, self.pages * gran))
                own = [journal.run(lambda: backend.create(gran), backend.release) for _ in range(self.pages)]
                self._map_run(0, own, journal)
                self._own = list(own)
        except BaseException:
            self._own = []
            raise
        try:
            self.tensor = backend.tensor(self.base + self.pad_bytes, experts * self.shard_bytes,
                                         original.dtype, original.shape)
            self.tensor.copy_(original)
            rows = host_rows(bound_groups, group_pages, gran, self.shard_bytes)
            flat = host_arena.take(rows * self.shard_bytes)
            self.host = flat.view(original.dtype).view(rows, *original.shape[1:])  # experts [R - rows, R)
            self.host.copy_(original[routed_experts - rows:routed_experts])
        except BaseException:
            self.close()
            raise

    def offload_pages(self, first_page: int, end_page: int, journal: Journal) -> list[PageHandle]:
        """Swap pages [first, end) from the layer's own pages to the staging alias (one run, access set
        once); return the own pages, highest first."""
        own = self._own[first_page:end_page]
        if any(h is None for h in own):
            raise VmmRuleError(f"pages [{first_page}, {end_page}) are already partly offloaded")
        for i in range(first_page, end_page):
            journal.run(lambda i=i: self._unmap(i), lambda _, i=i, h=self._own[i]: self._map(i, h))
        self._map_run(first_page, [self._alias[self._slot_index(i)] for i in range(first_page, end_page)],
                      journal)
        self._set_own(first_page, [None] * len(own), journal)
        return own[::-1]

    def restore_pages(self, first_page: int, end_page: int, handles: Sequence[PageHandle],
                      journal: Journal) -> None:
        """Swap pages [first, end) from the staging alias back to `handles` (content not copied here)."""
        handles = list(handles)
        if len(handles) != end_page - first_page or any(h is not None for h in self._own[first_page:end_page]):
            raise VmmRuleError(f"pages [{first_page}, {end_page}) are not all offloaded, or {len(handles)} "
                               f"handles for them")
        for i in range(first_page, end_page):
            journal.run(lambda i=i: self._unmap(i),
                        lambda _, i=i: self._map(i, self._alias[self._slot_index(i)]))
        self._map_run(first_page, handles, journal)
        self._set_own(first_page, handles, journal)

    def copy_from_host(self, first_expert: int, end_expert: int) -> None:
        """Write experts [first, end) back from the host copy (restore: new pages hold KV bytes)."""
        offset = self.routed_experts - self.host.shape[0]
        self.tensor[first_expert:end_expert].copy_(self.host[first_expert - offset:end_expert - offset])

    def close(self) -> None:
        """Unmap every page (own or alias), release the layer's own pages, free the reservation."""
        for i, handle in enumerate(self._own):
            self._unmap(i)
            if handle is not None:
                self.backend.release(handle)
        self._own = []
        self.backend.free_reservation(self.base, self.pages * self.backend.granularity_bytes)

    def _slot_index(self, page: int) -> int:
        return page - (self.routed_end_page - self.bound_pages)

    def _addr(self, page: int) -> int:
        return self.base + page * self.backend.granularity_bytes

    def _map(self, page: int, handle: PageHandle) -> None:
        self.backend.map(self._addr(page), handle)

    def _map_run(self, first_page: int, handles: Sequence[PageHandle], journal: Journal) -> None:
        """Map `handles` at pages first.. as one run; the undo unmaps them page by page."""
        journal.run(lambda: self.backend.map_run(self._addr(first_page), handles),
                    lambda _: [self._unmap(i) for i in range(first_page, first_page + len(handles))])

    def _set_own(self, first_page: int, handles: Sequence[PageHandle | None], journal: Journal) -> None:
        end = first_page + len(handles)
        old = self._own[first_page:end]
        self._own[first_page:end] = handles
        journal.record(lambda: self._own.__setitem__(slice(first_page, end), old))

    def _unmap(self, page: int) -> None:
        self.backend.unmap(self._addr(page), self.backend.granularity_bytes)


class ExpertStore:
    """An eligible MoE layer's w13 `[E, 2I, H]` and w2 `[E, H, I]`, with the offloaded tail movable."""

    def __init__(self, backend: PageBackend, layout: ExpertLayout, layer_id: int, w13: torch.Tensor,
                 w2: torch.Tensor, alias_w13: Sequence[PageHandle] = (), alias_w2: Sequence[PageHandle] = (),
                 host_arena: HostArena | None = None) -> None:
        """`host_arena` holds the host copies (one arena for all layers, `host_copy_bytes`); without one
        the store makes and owns an arena of its own."""
        _check_shapes(backend, layout, layer_id, w13, w2)
        self.backend = backend
        self.layout = layout
        self.layer_id = layer_id
        self.offloaded_groups = 0
        bound = layout.bound_groups
        self._own_arena = backend.host_arena(host_copy_bytes(layout, 1)) if host_arena is None else None
        arena = host_arena or self._own_arena
        try:
            self._w13 = PagedWeight(backend, w13, layout.w13_group_pages, bound, alias_w13, arena,
                                    layout.routed_experts)
        except BaseException:
            self._close_own_arena()
            raise
        try:
            self._w2 = PagedWeight(backend, w2, layout.w2_group_pages, bound, alias_w2, arena,
                                   layout.routed_experts)
        except BaseException:
            self._w13.close()
            self._close_own_arena()
            raise

    @property
    def w13(self) -> torch.Tensor:
        """Fixed-address `[E, 2I, H]` tensor for the MoE kernel."""
        return self._w13.tensor

    @property
    def w2(self) -> torch.Tensor:
        return self._w2.tensor

    @property
    def host_w13(self) -> torch.Tensor:
        """Host copy of the offloadable experts `[bound*g, 2I, H]`, made once at start."""
        return self._w13.host

    @property
    def host_w2(self) -> torch.Tensor:
        return self._w2.host

    @property
    def pages_per_group(self) -> int:
        return self.layout.pages_per_group_per_layer

    def offload_tail_pages(self, n_groups: int, journal: Journal | None = None) -> list[PageHandle]:
        """Move the boundary down by `n_groups`: their pages leave (returned, still live) and the range
        reads the staging slot instead. All or nothing unless `journal` is given (then the caller rolls back)."""
        self.layout.check_offloaded_groups(self.offloaded_groups + n_groups)
        if journal is None:  # inside a transaction its owner synchronises once (issue 10 item 8)
            self.backend.synchronize()
        with atomic(journal, on_failure=self.backend.synchronize) as j:
            freed = self._move(n_groups, j, lambda w, first, end: w.offload_pages(first, end, j))
            self._set_offloaded(self.offloaded_groups + n_groups, j)
            return freed

    def restore_tail(self, handles: Sequence[PageHandle] | None, n_groups: int,
                     journal: Journal | None = None) -> None:
        """Move the boundary up by `n_groups`: map `handles` (or fresh pages when None) behind the
        returning experts and copy them back from the host copy."""
        self.layout.check_offloaded_groups(self.offloaded_groups - n_groups)
        need = n_groups * self.pages_per_group
        if journal is None:
            self.backend.synchronize()
        with atomic(journal, on_failure=self.backend.synchronize) as j:
            if handles is None:
                gran = self.backend.granularity_bytes
                handles = [j.run(lambda: self.backend.create(gran), self.backend.release) for _ in range(need)]
            if len(handles) != need or any(h.nbytes != self.backend.granularity_bytes for h in handles):
                raise VmmRuleError(f"restore_tail({n_groups}) needs {need} single pages, got {len(handles)}")
            old_boundary = self.boundary_expert
            pages = iter(handles)
            self._move(-n_groups, j, lambda w, first, end: w.restore_pages(
                first, end, [next(pages) for _ in range(first, end)], j))
            self._set_offloaded(self.offloaded_groups - n_groups, j)
            self.copy_from_host(old_boundary, self.boundary_expert)

    def copy_from_host(self, first_expert: int, end_expert: int) -> None:
        """Write experts [first, end) of both weights back from the host copy (their pages may hold KV
        bytes: a restore, or an offload being rolled back)."""
        for weight in (self._w13, self._w2):
            weight.copy_from_host(first_expert, end_expert)

    @property
    def boundary_expert(self) -> int:
        return self.layout.boundary_expert(self.offloaded_groups)

    @property
    def routed_experts(self) -> int:
        """End of the offloaded rows [boundary_expert, routed_experts); fused shared experts lie above."""
        return self.layout.routed_experts

    def staging_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) copies that fill this layer's offloaded experts from the host copy:
        the destination is the tensor's own offloaded rows, which alias the staging slot (paper V-B)."""
        b, end = self.boundary_expert, self.routed_experts
        return [(w.tensor[b:end], w.host[w.host.shape[0] - (end - b):]) for w in (self._w13, self._w2)]

    def staged_bytes(self) -> int:
        return sum(dst.numel() * dst.element_size() for dst, _ in self.staging_pairs())

    def expert_checksums(self, first_expert: int = 0, end_expert: int | None = None) -> list[int]:
        """CRC32 of each expert's w13 and w2 bytes (integrity checks across remaps)."""
        end = self.boundary_expert if end_expert is None else end_expert
        return [bytes_checksum(self.w13[e]) ^ (bytes_checksum(self.w2[e]) << 1) for e in range(first_expert, end)]

    def close(self) -> None:
        self.backend.synchronize()
        self._w13.close()
        self._w2.close()
        self._close_own_arena()

    def _close_own_arena(self) -> None:
        if self._own_arena is not None:
            self._own_arena.close()
            self._own_arena = None

    def _move(self, n_groups: int, journal: Journal, step) -> list[PageHandle]:
        """Apply `step(weight, first_page, end_page)` over the pages of the groups crossing the boundary."""
        lo, hi = sorted((self.offloaded_groups, self.offloaded_groups + n_groups))
        out: list[PageHandle] = []
        for w in (self._w13, self._w2):
            result = step(w, w.routed_end_page - hi * w.group_pages, w.routed_end_page - lo * w.group_pages)
            out.extend(result or ())
        return out

    def _set_offloaded(self, groups: int, journal: Journal) -> None:
        old = self.offloaded_groups
        self.offloaded_groups = groups
        journal.record(lambda: setattr(self, "offloaded_groups", old))


def host_rows(bound_groups: int, group_pages: int, granularity_bytes: int, shard_bytes: int) -> int:
    """Expert rows of one weight's host copy: every row that may leave (its pages reach the bound)."""
    return bound_groups * group_pages * granularity_bytes // shard_bytes


def host_copy_bytes(layout: ExpertLayout, layers: int | None = None) -> int:
    """Host arena bytes for the host copies of `layers` eligible layers (all of them by default)."""
    n = len(layout.eligible_layer_ids) if layers is None else layers
    gran, bound = layout.granularity_bytes, layout.bound_groups
    sizes = [host_rows(bound, pages, gran, shard) * shard
             for pages, shard in ((layout.w13_group_pages, layout.w13_shard_bytes),
                                  (layout.w2_group_pages, layout.w2_shard_bytes))]
    return n * HostArena.bytes_for(sizes)


def _check_shapes(backend: PageBackend, layout: ExpertLayout, layer_id: int, w13: torch.Tensor,
                  w2: torch.Tensor) -> None:
    if layout.eligible_index(layer_id) is None:
        raise LayoutError(f"layer_id {layer_id} is not an offload-eligible MoE layer "
                          f"{layout.eligible_layer_ids}")
    if backend.granularity_bytes != layout.granularity_bytes:
        raise LayoutError(f"backend granularity_bytes {backend.granularity_bytes} != layout "
                          f"granularity_bytes {layout.granularity_bytes}")
    for name, t, shard in (("w13", w13, layout.w13_shard_bytes), ("w2", w2, layout.w2_shard_bytes)):
        if t.dim() != 3 or t.shape[0] != layout.local_experts:
            raise LayoutError(f"{name} shape {tuple(t.shape)} must be [E={layout.local_experts}, ., .]")
        if t[0].numel() * t.element_size() != shard:
            raise LayoutError(f"{name} shard is {t[0].numel() * t.element_size()} bytes, layout says {shard}")
