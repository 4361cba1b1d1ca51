"""Page backends: the CUDA VMM rules, map/unmap/alias, remap integrity, deferred release, faults, leaks.

Every test runs on real host pages; the `backend` fixture also runs them on the CUDA backend when a
driver and device exist (marked gpu), so both backends are held to the same semantics.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vamp_sglang.memory import BackendUnavailableError, PageHandle, VmmRuleError, select_backend
from vamp_sglang.memory.backend import HostArena, LiveCounts
from vamp_sglang.memory.host_backend import HostPageBackend

GRAN = 64 << 10  # small pages keep the tests small; a multiple of the 4 KiB OS page
REPO = Path(__file__).resolve().parents[1]


def _cuda_backend_or_reason():
    try:
        return select_backend("cuda", "cuda:0"), None
    except BackendUnavailableError:
        return None, "needs a CUDA driver and device (none here)"


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    if request.param == "host":
        b = HostPageBackend("cpu", granularity_bytes=GRAN)
    else:
        b, reason = _cuda_backend_or_reason()
        if b is None:
            pytest.skip(reason)
    yield b
    b.close()


def gran(b):
    return b.granularity_bytes


def fill(b, addr, nbytes, value):
    b.tensor(addr, nbytes, torch.int32, (nbytes // 4,)).fill_(value)


def read(b, addr, nbytes):
    return b.tensor(addr, nbytes, torch.int32, (nbytes // 4,)).cpu()


def all_equal(b, addr, nbytes, value):
    return bool((read(b, addr, nbytes) == value).all())


# ---- rules ---------------------------------------------------------------------------------------------


def test_rules_are_enforced_and_state_is_unchanged(backend):
    g = gran(backend)
    base = backend.reserve(4 * g)
    h1, h2 = backend.create(g), backend.create(2 * g)
    backend.map(base + g, h2)  # occupies [g, 3g)
    before = backend.live_counts()
    bad_calls = {
        "reserve size not a multiple": lambda: backend.reserve(g + 4096),
        "create size not a multiple": lambda: backend.create(g // 2),
        "map at a misaligned address": lambda: backend.map(base + 4096, h1),
        "map outside any reservation": lambda: backend.map(base + 4 * g, h1),
        "map straddling the reservation end": lambda: backend.map(base + 3 * g, h2),
        "map over a live mapping": lambda: backend.map(base + 2 * g, h1),
        "unmap a sub-range of a mapping": lambda: backend.unmap(base + g, g),
        "unmap from the middle of a mapping": lambda: backend.unmap(base + 2 * g, g),
        "unmap an unmapped range": lambda: backend.unmap(base, g),
        "free a mapped reservation": lambda: backend.free_reservation(base, 4 * g),
        "free part of a reservation": lambda: backend.free_reservation(base, 2 * g),
        "map a foreign handle": lambda: backend.map(base, PageHandle(nbytes=g, raw=0)),
        "view past the reservation": lambda: backend.tensor(base, 5 * g, torch.uint8, (5 * g,)),
        "view larger than its nbytes": lambda: backend.tensor(base, g, torch.uint8, (g + 1,)),
    }
    for what, call in bad_calls.items():
        with pytest.raises(VmmRuleError):
            call()
        assert backend.live_counts() == before, what
    assert backend.is_mapped(base + g, 2 * g) and not backend.is_mapped(base, g)
    backend.unmap(base + g, 2 * g)
    backend.free_reservation(base, 4 * g)
    backend.release(h1)
    backend.release(h2)


def test_unmap_takes_exactly_one_mapping_even_when_neighbours_are_adjacent(backend):
    g = gran(backend)
    base = backend.reserve(2 * g)
    h1, h2 = backend.create(g), backend.create(g)
    backend.map(base, h1)
    backend.map(base + g, h2)
    with pytest.raises(VmmRuleError):
        backend.unmap(base, 2 * g)  # cuMemUnmap cannot span two mappings either
    backend.unmap(base, g)
    assert backend.is_mapped(base + g, g) and not backend.is_mapped(base, g)


def test_released_handle_cannot_be_mapped_or_released_again(backend):
    g = gran(backend)
    base = backend.reserve(g)
    h = backend.create(g)
    backend.release(h)
    with pytest.raises(VmmRuleError):
        backend.map(base, h)
    with pytest.raises(VmmRuleError):
        backend.release(h)


def test_host_granularity_must_be_a_multiple_of_the_os_page():
    with pytest.raises(VmmRuleError, match="granularity_bytes"):
        HostPageBackend("cpu", granularity_bytes=GRAN + 100)


# ---- data across map / unmap / alias -------------------------------------------------------------------


def test_alias_two_addresses_see_the_same_pages(backend):
    g = gran(backend)
    a, b = backend.reserve(g), backend.reserve(g)
    h = backend.create(g)
    backend.map(a, h)
    backend.map(b, h)
    fill(backend, a, g, 7)
    assert all_equal(backend, b, g, 7)
    fill(backend, b, g, 9)
    assert all_equal(backend, a, g, 9)


def test_data_survives_remapping_a_handle_to_another_reservation(backend):
    g = gran(backend)
    src, dst = backend.reserve(3 * g), backend.reserve(3 * g)
    handles = [backend.create(g) for _ in range(3)]
    for i, h in enumerate(handles):
        backend.map(src + i * g, h)
        fill(backend, src + i * g, g, 100 + i)
    backend.synchronize()
    for i, h in enumerate(handles):
        backend.unmap(src + i * g, g)
    for i, h in enumerate(reversed(handles)):  # reversed order: pages carry their data, not their address
        backend.map(dst + i * g, h)
    assert [int(read(backend, dst + i * g, g)[0]) for i in range(3)] == [102, 101, 100]
    assert all(all_equal(backend, dst + i * g, g, 102 - i) for i in range(3))


def test_release_is_deferred_until_the_last_mapping_goes():
    b = HostPageBackend("cpu", granularity_bytes=GRAN)
    try:
        base = b.reserve(2 * GRAN)
        h = b.create(GRAN)
        b.map(base, h)
        b.map(base + GRAN, h)
        fill(b, base, GRAN, 5)
        b.release(h)
        assert b.committed_bytes == GRAN and b.live_counts().handles == 1
        assert all_equal(b, base + GRAN, GRAN, 5)  # still readable while mapped
        b.unmap(base, GRAN)
        assert b.committed_bytes == GRAN
        b.unmap(base + GRAN, GRAN)
        assert b.committed_bytes == 0 and b.live_counts().handles == 0
        fresh = b.create(GRAN)  # the punched range is reused and reads as zeros
        assert fresh.raw == h.raw
        b.map(base, fresh)
        assert all_equal(b, base, GRAN, 0)
    finally:
        b.close()


# ---- faults and failures -------------------------------------------------------------------------------

FAULT_CHILD = textwrap.dedent("""
    import sys, torch
    from vamp_sglang.memory import PagedRegion, select_backend
    b = select_backend("host", "cpu", granularity_bytes=65536)
    r = PagedRegion(b, 4 * 65536)
    r.extend([b.create(65536) for _ in range(2)])
    whole = r.view(torch.float32, (4 * 65536 // 4,))   # spans the reserved, unmapped tail too
    whole[: 2 * 65536 // 4].fill_(1.0)
    r.pop_tail()
    print("mapped ok", float(whole[0]), flush=True)
    target = {"unmapped_page": 65536 // 4, "reserved_tail": 3 * 65536 // 4}[sys.argv[1]]
    whole[target].fill_(2.0)
    print("NO FAULT", flush=True)
""")


@pytest.mark.parametrize("where", ["unmapped_page", "reserved_tail"])
def test_touching_unmapped_va_faults_in_a_subprocess(where):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", FAULT_CHILD, where], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert "mapped ok 1.0" in proc.stdout, proc.stderr
    assert "NO FAULT" not in proc.stdout
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])


class FlakyHostBackend(HostPageBackend):
    """Real host pages whose second map step (page population, the host's cuMemSetAccess) fails on demand."""

    fail_populate = False

    def _populate(self, addr, nbytes):
        if self.fail_populate:
            raise OSError(12, "injected: populate failed after the mmap went in")
        super()._populate(addr, nbytes)


def vma_perms(addr):
    """Permissions of the VMA holding `addr` in this process, e.g. '---p' for a placeholder."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            return line.split()[1]
    return None


def test_a_map_failing_half_way_restores_the_placeholder_and_the_books():
    b = FlakyHostBackend("cpu", granularity_bytes=GRAN)
    try:
        base = b.reserve(2 * GRAN)
        h = b.create(GRAN)
        fill_handle = b.create(GRAN)
        b.map(base + GRAN, fill_handle)
        before = b.live_counts()
        b.fail_populate = True
        with pytest.raises(OSError, match="injected"):
            b.map(base, h)
        assert b.live_counts() == before and not b.is_mapped(base, GRAN)
        assert vma_perms(base) == "---p"  # the memfd pages are gone from that VA, the placeholder is back
        assert vma_perms(base + GRAN) == "rw-s"
        b.fail_populate = False
        b.map(base, h)  # the same handle maps cleanly afterwards
        fill(b, base, GRAN, 3)
        assert all_equal(b, base, GRAN, 3)
    finally:
        b.close()


# ---- selection and leaks -------------------------------------------------------------------------------


def test_selection_by_device_and_clear_errors_without_a_driver():
    host = select_backend("auto", torch.device("cpu"), granularity_bytes=GRAN)
    assert host.name == "host" and host.granularity_bytes == GRAN
    host.close()
    with pytest.raises(BackendUnavailableError, match="cpu"):
        select_backend("host", "cuda:0")
    with pytest.raises(BackendUnavailableError, match="CUDA devices only"):
        select_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="page_backend must be one of"):
        select_backend("gpu", "cpu")
    if _cuda_backend_or_reason()[0] is None:  # this machine: the driver library is missing
        with pytest.raises(BackendUnavailableError, match="cuda page backend"):
            select_backend("auto", "cuda:0")


def fds_and_vmas():
    return len(os.listdir("/proc/self/fd")), len(Path("/proc/self/maps").read_text().splitlines())


def cycle_backend():
    b = HostPageBackend("cpu", granularity_bytes=GRAN)
    a, c = b.reserve(8 * GRAN), b.reserve(8 * GRAN)
    handles = [b.create(GRAN) for _ in range(8)]
    for i, h in enumerate(handles):
        b.map(a + i * GRAN, h)
    fill(b, a, 8 * GRAN, 1)
    for i, h in enumerate(handles[4:]):
        b.unmap(a + (4 + i) * GRAN, GRAN)
        b.map(c + i * GRAN, h)
        b.release(h)
    b.close()  # force-closes what is left: 4 mappings in a, 4 in c, 2 reservations, 4 handles
    assert b.live_counts().reservations == b.live_counts().mappings == b.live_counts().handles == 0


def test_close_leaves_no_fd_or_vma_behind():
    cycle_backend()  # warm up torch / allocator VMAs
    before = fds_and_vmas()
    for _ in range(3):
        cycle_backend()
    assert fds_and_vmas() == before


# ---- runs of pages and the host arena (issue 10 items 3 and 8) ------------------------------------------

def test_map_run_maps_pages_as_separate_mappings_with_one_access_call(backend):
    g = gran(backend)
    base = backend.reserve(4 * g)
    handles = [backend.create(g) for _ in range(3)]
    backend.map_run(base, handles)
    assert backend.is_mapped(base, 3 * g) and not backend.is_mapped(base + 3 * g, g)
    for k in range(3):
        fill(backend, base + k * g, g, k + 1)
    backend.unmap(base + g, g)  # each page is still its own mapping
    assert all_equal(backend, base, g, 1) and all_equal(backend, base + 2 * g, g, 3)
    with pytest.raises(VmmRuleError, match="overlaps"):
        backend.map_run(base + 2 * g, [handles[1]])
    with pytest.raises(VmmRuleError, match="twice"):
        backend.map_run(base + 3 * g, [handles[1], handles[1]])
    backend.map_run(base + g, [handles[1]])
    assert all_equal(backend, base + g, g, 2)  # the page kept its bytes
    for k in range(3):
        backend.unmap(base + k * g, g)
    backend.free_reservation(base, 4 * g)
    for h in handles:
        backend.release(h)
    assert backend.live_counts() == LiveCounts(0, 0, 0)


def test_host_arena_holds_exactly_what_is_asked_in_aligned_slices(backend):
    sizes = [1000, 3 * 4096 + 1, 256]
    arena = backend.host_arena(HostArena.bytes_for(sizes))
    assert arena.nbytes == 1024 + 12544 + 256  # aligned to 256 bytes, no power-of-two rounding
    slices = [arena.take(n) for n in sizes]
    assert [s.numel() for s in slices] == sizes
    assert all(s.data_ptr() % HostArena.ALIGN_BYTES == 0 for s in slices)
    assert len({s.untyped_storage().data_ptr() for s in slices}) == 1  # one allocation
    with pytest.raises(VmmRuleError, match="do not fit"):
        arena.take(1)
    if backend.name == "cuda":  # page-locked: the copy engine reads it directly
        assert arena.pinned_bytes == 4 * 4096 and all(s.is_pinned() for s in slices)
    else:
        assert arena.pinned_bytes == 0
    arena.close()
    with pytest.raises(VmmRuleError, match="closed"):
        arena.take(1)
