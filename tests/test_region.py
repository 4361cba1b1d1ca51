"""PagedRegion on real host pages: tail growth and shrink, in-place regrow, all-or-nothing failures."""

import ctypes
import errno
import mmap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vamp_sglang.memory import PagedRegion, VmmRuleError
from vamp_sglang.memory.host_backend import HostPageBackend

GRAN = 64 << 10
WORDS = GRAN // 4


@pytest.fixture
def backend():
    b = HostPageBackend("cpu", granularity_bytes=GRAN)
    yield b
    b.close()


def tagged_pages(backend, region, n, first_tag):
    """Create n pages, map them at the region's tail and fill page i with first_tag + i."""
    handles = [backend.create(GRAN) for _ in range(n)]
    start = region.mapped_bytes
    region.extend(handles)
    for i in range(n):
        region.fill_from(torch.full((WORDS,), first_tag + i, dtype=torch.int32), start + i * GRAN)
    return handles


def page_tags(region):
    v = region.view(torch.int32, (region.mapped_bytes // 4,)).view(-1, WORDS)
    assert bool((v == v[:, :1]).all()), "a page holds mixed data"
    return v[:, 0].tolist()


def test_growth_is_visible_through_the_existing_tensor_object(backend):
    kv = PagedRegion(backend, 8 * GRAN)
    tagged_pages(backend, kv, 2, 10)
    k_buffer = kv.view(torch.int32, (2, WORDS))
    holders = [k_buffer]  # e.g. SGLang's per-layer buffer list keeps this object
    ptr = k_buffer.data_ptr()
    tagged_pages(backend, kv, 3, 20)
    kv.regrow(k_buffer, (5, WORDS))
    assert holders[0] is k_buffer and holders[0].shape == (5, WORDS) and k_buffer.data_ptr() == ptr
    assert holders[0][:, 0].tolist() == [10, 11, 20, 21, 22]
    holders[0][4].fill_(99)
    assert page_tags(kv)[4] == 99
    kv.pop_tail()
    kv.regrow(k_buffer, (4, WORDS))  # shrink the same way
    assert holders[0].shape == (4, WORDS)


def test_regrow_from_an_empty_view(backend):
    kv = PagedRegion(backend, 4 * GRAN)
    t = kv.view(torch.int32, (0, WORDS))  # a pool that starts with no pages
    tagged_pages(backend, kv, 2, 4)
    kv.regrow(t, (2, WORDS))
    assert t[:, 0].tolist() == [4, 5]


def test_regrow_refuses_a_foreign_tensor_or_a_shape_past_the_reservation(backend):
    kv = PagedRegion(backend, 2 * GRAN)
    tagged_pages(backend, kv, 1, 0)
    t = kv.view(torch.int32, (WORDS,))
    with pytest.raises(VmmRuleError, match="region base"):
        kv.regrow(torch.zeros(4, dtype=torch.int32), (8,))
    with pytest.raises(VmmRuleError, match="nbytes"):
        kv.regrow(t, (2 * WORDS + 1,))
    assert t.shape == (WORDS,)


def test_pages_move_from_an_expert_region_to_a_kv_tail_and_back_with_their_data(backend):
    experts, kv = PagedRegion(backend, 6 * GRAN), PagedRegion(backend, 6 * GRAN)
    tagged_pages(backend, experts, 6, 100)
    tagged_pages(backend, kv, 2, 0)
    resident_sums = experts.page_checksums()[:4]
    moved = [experts.pop_tail(), experts.pop_tail()]
    kv.extend(moved)
    assert page_tags(kv) == [0, 1, 105, 104]  # the handles carry the expert bytes
    assert experts.page_checksums() == resident_sums
    kv.fill_from(torch.tensor([-1, -2], dtype=torch.int32).repeat_interleave(WORDS), 2 * GRAN)  # KV writes
    back = [kv.pop_tail(), kv.pop_tail()]
    experts.extend(back[::-1])
    assert page_tags(kv) == [0, 1] and page_tags(experts) == [100, 101, 102, 103, -1, -2]


def test_append_past_the_reservation_is_refused(backend):
    r = PagedRegion(backend, 2 * GRAN)
    tagged_pages(backend, r, 2, 0)
    spare = backend.create(GRAN)
    with pytest.raises(VmmRuleError, match="reserved_bytes"):
        r.append(spare)
    with pytest.raises(VmmRuleError, match="not all mapped"):
        r.fill_from(torch.zeros(WORDS, dtype=torch.int32), 2 * GRAN)
    assert r.mapped_bytes == 2 * GRAN


class FailingMapBackend(HostPageBackend):
    """Real host pages. Once armed, the page mmap number `fail_at` (0-based) of a run fails, or with
    fail_at == "populate" the run's one page population (the host's cuMemSetAccess) fails after every
    mmap went in."""

    fail_at = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._libc = _FailingMmap(self._libc, self)

    def _populate(self, addr, nbytes):
        if self.fail_at == "populate":
            self.fail_at = None
            raise OSError(12, "injected populate failure")
        super()._populate(addr, nbytes)


class _FailingMmap:
    """libc with the armed backend's page mmap (MAP_SHARED of the memfd) failing with ENOMEM."""

    def __init__(self, libc, backend):
        self._libc, self._backend = libc, backend

    def __getattr__(self, name):
        return getattr(self._libc, name)

    def mmap(self, addr, nbytes, prot, flags, fd, offset):
        b = self._backend
        if flags & mmap.MAP_SHARED and isinstance(b.fail_at, int):
            b.fail_at -= 1
            if b.fail_at < 0:
                b.fail_at = None
                ctypes.set_errno(errno.ENOMEM)
                return ctypes.c_void_p(-1).value
        return self._libc.mmap(addr, nbytes, prot, flags, fd, offset)


@pytest.mark.parametrize("fail_at", [0, 1, 2, 3, "populate"])
def test_extend_failing_at_any_page_leaves_the_region_unchanged(fail_at):
    b = FailingMapBackend("cpu", granularity_bytes=GRAN)
    try:
        r = PagedRegion(b, 8 * GRAN)
        tagged_pages(b, r, 2, 1)
        before = (r.mapped_bytes, r.handles, r.page_checksums(), b.live_counts())
        new = [b.create(GRAN) for _ in range(4)]
        b.fail_at = fail_at
        with pytest.raises(OSError, match="injected|Cannot allocate"):
            r.extend(new)
        assert (r.mapped_bytes, r.handles, r.page_checksums()) == before[:3]
        assert b.live_counts().mappings == before[3].mappings
        assert not b.is_mapped(r.base + 2 * GRAN, GRAN)
        r.extend(new)  # every handle is still live and usable
        assert r.mapped_bytes == 6 * GRAN
    finally:
        b.close()


def test_extend_sets_access_once_per_run():
    """Issue 10 item 8: a run of pages is populated (the host's cuMemSetAccess) in one call."""
    b = CountingPopulateBackend("cpu", granularity_bytes=GRAN)
    try:
        r = PagedRegion(b, 8 * GRAN)
        r.append_new_pages(5)
        assert b.populate_calls == [5 * GRAN]
        r.append_new_pages(1)
        assert b.populate_calls == [5 * GRAN, GRAN]
    finally:
        b.close()


class CountingPopulateBackend(HostPageBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.populate_calls = []

    def _populate(self, addr, nbytes):
        self.populate_calls.append(nbytes)
        super()._populate(addr, nbytes)


class FailingUnmapBackend(HostPageBackend):
    refuse_unmap = False

    def _unmap_raw(self, addr, nbytes):
        if self.refuse_unmap:
            raise OSError(16, "injected unmap refusal")
        super()._unmap_raw(addr, nbytes)


def test_pop_tail_failing_leaves_the_region_unchanged():
    b = FailingUnmapBackend("cpu", granularity_bytes=GRAN)
    try:
        r = PagedRegion(b, 4 * GRAN)
        tagged_pages(b, r, 3, 7)
        before = (r.mapped_bytes, r.handles, r.page_checksums())
        b.refuse_unmap = True
        with pytest.raises(OSError, match="injected"):
            r.pop_tail()
        assert (r.mapped_bytes, r.handles, r.page_checksums()) == before
        b.refuse_unmap = False
    finally:
        b.close()


def test_close_returns_live_handles_and_frees_the_reservation(backend):
    r = PagedRegion(backend, 4 * GRAN)
    handles = tagged_pages(backend, r, 3, 0)
    assert r.close() == handles
    assert backend.live_counts().reservations == 0 and backend.live_counts().mappings == 0
    with pytest.raises(VmmRuleError, match="closed"):
        r.append(handles[0])
    for h in handles:
        backend.release(h)
    assert backend.committed_bytes == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a_to_b", "b_to_a"]), st.integers(1, 3)), max_size=12))
def test_random_page_moves_keep_every_page_s_bytes(moves):
    """Model check: pages shuttle between two regions' tails; each page keeps its own tag throughout."""
    b = HostPageBackend("cpu", granularity_bytes=GRAN)
    try:
        a, c = PagedRegion(b, 8 * GRAN), PagedRegion(b, 8 * GRAN)
        tagged_pages(b, a, 6, 0)
        tagged_pages(b, c, 2, 50)
        model = {"a": [0, 1, 2, 3, 4, 5], "b": [50, 51]}
        regions = {"a": a, "b": c}
        for move, n in moves:
            src, dst = ("a", "b") if move == "a_to_b" else ("b", "a")
            n = min(n, len(model[src]), (8 * GRAN - regions[dst].mapped_bytes) // GRAN)
            for _ in range(n):
                regions[dst].append(regions[src].pop_tail())
                model[dst].append(model[src].pop())
            assert page_tags(a) == model["a"] and page_tags(c) == model["b"]
        assert b.live_counts().mappings == 8
    finally:
        b.close()
