"""The CUDA backend's host arena, the parts that run without a GPU (the first H200 run found both).

- torch's `is_pinned()` asks the driver about a tensor's storage's FIRST byte, so the registered range
  must start where the storage starts: an arena carved out of a larger malloc'd block read as not pinned.
- The registration must end before the memory can be freed: an arena dropped by a build that failed
  half-way left its range in the driver's table, and the next arena at that address failed to register
  (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) in every gpu_check section after it.
"""

import gc

import torch

from vamp_sglang.memory.backend import HostArena
from vamp_sglang.memory.cuda_backend import page_aligned_host_buffer

OS_PAGE_BYTES = 4096


def test_the_buffer_is_its_storage_from_a_page_boundary():
    for nbytes in (1, 4096, 3 * 4096 + 5, 9 << 20):
        buffer = page_aligned_host_buffer(nbytes)
        assert buffer.numel() == nbytes and buffer.dtype == torch.uint8
        assert buffer.data_ptr() == buffer.untyped_storage().data_ptr()  # what is_pinned() looks up
        assert buffer.data_ptr() % OS_PAGE_BYTES == 0  # cuMemHostRegister locks from here
    assert page_aligned_host_buffer(0).numel() == 0


def test_the_buffer_is_private_anonymous_memory():
    """Not shmem (Python's default for an anonymous mapping is MAP_SHARED): /proc/self/maps says 'p'."""
    buffer = page_aligned_host_buffer(3 * OS_PAGE_BYTES)
    start = buffer.data_ptr()
    with open("/proc/self/maps") as maps:
        lines = [line.split() for line in maps]
    (perms,) = [f[1] for f in lines if int(f[0].split("-")[0], 16) <= start < int(f[0].split("-")[1], 16)]
    assert perms.startswith("rw") and perms.endswith("p")


def test_the_buffer_keeps_its_mapping_alive_and_writable():
    views = [page_aligned_host_buffer(2 * OS_PAGE_BYTES)[OS_PAGE_BYTES:] for _ in range(3)]
    gc.collect()  # only the views hold the mappings now
    for k, view in enumerate(views):
        view.fill_(k + 1)
    assert [int(v.sum()) for v in views] == [(k + 1) * OS_PAGE_BYTES for k in range(3)]


def test_release_runs_once_at_close():
    calls = []
    arena = HostArena(4096, pinned_bytes=4096, release=lambda: calls.append(1),
                      buffer=page_aligned_host_buffer(4096))
    slice_ = arena.take(100)
    arena.close()
    arena.close()
    del arena
    gc.collect()
    assert calls == [1] and slice_.numel() == 100


def test_an_arena_dropped_without_close_is_released_before_its_memory_goes():
    calls = []
    buffer = page_aligned_host_buffer(4096)

    def release():  # the unregistration: the memory must still be there
        calls.append(int(buffer[:8].sum()))

    arena = HostArena(4096, pinned_bytes=4096, release=release, buffer=buffer)
    arena.take(8).fill_(2)
    del arena
    gc.collect()
    assert calls == [16]
