"""GrowableKVBuffers on real host pages: growth through the same tensor objects, exact row arithmetic,
shrinking only over free rows, and dropped rows really unmapped."""

import subprocess
import sys
import textwrap

import pytest
import torch

from vamp_sglang.memory.backend import VmmRuleError
from vamp_sglang.memory.backend_choice import select_backend
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers, KVShrinkError

GRAN = 64 * 1024


@pytest.fixture
def backend():
    be = select_backend("host", "cpu", granularity_bytes=GRAN)
    yield be
    be.close()


def pages(backend, n):
    return [backend.create(GRAN) for _ in range(n)]


def test_growth_is_visible_through_the_existing_tensor_objects(backend):
    kv = GrowableKVBuffers(backend, layers=2, heads=2, head_dim=16, dtype=torch.float32,
                           initial_rows=1024, max_rows=8192)  # row 128 B: 512 rows per page
    holders = [kv.k_buffers, kv.v_buffers]  # like SGLang's k_buffer / v_buffer lists
    ids = [id(t) for t in kv.k_buffers + kv.v_buffers]
    ptrs = [t.data_ptr() for t in kv.k_buffers + kv.v_buffers]
    for i, t in enumerate(kv.k_buffers + kv.v_buffers):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t) + i)
    before = kv.checksums()
    assert kv.grow(pages(backend, 4 * 3)) == 1024 + 3 * 512
    assert [id(t) for t in kv.k_buffers + kv.v_buffers] == ids
    assert [t.data_ptr() for t in kv.k_buffers + kv.v_buffers] == ptrs
    assert all(t.shape == (2560, 2, 16) for t in holders[0] + holders[1])
    assert kv.checksums(1024) == before  # old rows kept
    holders[0][1][2559].fill_(3.5)  # the new tail is writable memory
    assert float(kv.k_buffers[1][2559, 1, 15]) == 3.5
    kv.close()


def test_capacity_counts_whole_rows_when_pages_do_not_divide(backend):
    # row = 3 heads * 40 * 4 B = 480 B; a 64 KiB page holds 136.53 rows
    kv = GrowableKVBuffers(backend, 1, 3, 40, torch.float32, initial_rows=100, max_rows=2000)
    assert (kv.pages_per_buffer, kv.row_capacity) == (1, 136)
    assert kv.grow(pages(backend, 2)) == 273  # one page for K, one for V: 2 pages = 273.07 rows
    assert kv.grow(pages(backend, 2)) == 409
    assert kv.max_row_capacity == 2048  # 2000 rows need 14.6 pages: 15 reserved hold 2048 rows
    kv.close()
    kv = GrowableKVBuffers(backend, 1, 3, 40, torch.float32, 100, 2000, row_multiple=16)
    assert kv.row_capacity == 128
    assert kv.grow(pages(backend, 2)) == 272
    kv.close()
    kv = GrowableKVBuffers(backend, 1, 3, 40, torch.float32, 136, 2000, row_multiple=16)
    assert (kv.pages_per_buffer, kv.row_capacity) == (2, 272)  # one page rounds down to 128 < 136
    kv.close()


def test_grow_rejects_uneven_or_oversized_page_sets(backend):
    kv = GrowableKVBuffers(backend, 2, 2, 16, torch.float32, 512, 2048)  # 4 pages per buffer at most
    extra = pages(backend, 3)
    with pytest.raises(VmmRuleError, match="split evenly"):
        kv.grow(extra)
    too_many = extra + pages(backend, 4 * 4 - 3)
    with pytest.raises(VmmRuleError, match="exceed the reservation"):
        kv.grow(too_many)
    assert (kv.pages_per_buffer, kv.row_capacity) == (1, 512)
    for h in too_many:
        backend.release(h)
    kv.close()


def test_shrink_only_over_free_rows_and_returns_the_tail_pages(backend):
    kv = GrowableKVBuffers(backend, 2, 2, 16, torch.float32, 512, 4096)
    added = pages(backend, 4 * 2)
    kv.grow(added)
    seen = []
    with pytest.raises(KVShrinkError, match=r"\[1024, 1536\)"):
        kv.shrink(1, lambda lo, hi: seen.append((lo, hi)) or False)
    assert seen == [(1024, 1536)] and kv.row_capacity == 1536 and kv.pages_per_buffer == 3
    back = kv.shrink(2, lambda lo, hi: True)
    assert kv.row_capacity == 512 and kv.pages_per_buffer == 1
    assert set(back) == set(added)  # exactly the pages that were appended
    assert kv.grow(back) == 1536
    with pytest.raises(VmmRuleError, match="n_pages"):
        kv.shrink(4, lambda lo, hi: True)
    kv.close()
    assert backend.live_counts().handles == 0


def test_rows_dropped_by_shrink_are_unmapped():
    """Touching a dropped row through a view taken before the shrink faults (child process)."""
    code = textwrap.dedent(f"""
        import torch
        from vamp_sglang.memory.backend_choice import select_backend
        from vamp_sglang.memory.kv_buffers import GrowableKVBuffers
        be = select_backend("host", "cpu", granularity_bytes={GRAN})
        kv = GrowableKVBuffers(be, 1, 2, 16, torch.float32, 512, 2048)
        kv.grow([be.create({GRAN}) for _ in range(2)])
        old_view = kv.k_buffers[0][:1024]
        old_view[1000].fill_(1.0)
        kv.shrink(1, lambda lo, hi: True)
        print("shrunk", kv.row_capacity, flush=True)
        old_view[1000].fill_(2.0)
        print("no fault", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert "shrunk 512" in proc.stdout
    assert "no fault" not in proc.stdout and proc.returncode == -11, proc.stderr
