"""gpu_check section `backend`: the CUDA page backend moves expert pages to a KV region and back, the KV
tensor grows in place, every checksum survives, the host copy is page-locked (GPU only), nothing leaks."""

from __future__ import annotations

import torch

from eval.gpu_sections.toy_moe import KV_ROW_SHAPE
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.region import PagedRegion


def check(backend: PageBackend, gpu: bool) -> dict:
    """Expert pages -> KV tail -> back, with checksums and an in-place grown KV tensor."""
    g = backend.granularity_bytes
    experts, kv = PagedRegion(backend, 16 * g), PagedRegion(backend, 24 * g)
    experts.append_new_pages(16)
    kv.append_new_pages(8)
    gen = torch.Generator(device=backend.device).manual_seed(0)
    expert_bytes = experts.view(torch.uint8, (16 * g,))
    expert_bytes.copy_(torch.randint(0, 256, (16 * g,), dtype=torch.uint8, device=backend.device, generator=gen))
    tokens_per_page = g // (2 * KV_ROW_SHAPE[0] * KV_ROW_SHAPE[1])
    k_buffer = kv.view(torch.bfloat16, (8 * tokens_per_page, *KV_ROW_SHAPE))
    k_buffer.fill_(3.0)
    holders, ptr = [k_buffer], k_buffer.data_ptr()
    expert_sums, kv_sums = experts.page_checksums(), kv.page_checksums()
    arena = backend.host_arena(8 * g)
    host_copy = arena.take(8 * g)
    host_copy.copy_(expert_bytes[8 * g:])

    backend.synchronize()
    moved = [experts.pop_tail() for _ in range(8)]  # high-index pages leave first
    kv.extend(moved)
    kv.regrow(k_buffer, (16 * tokens_per_page, *KV_ROW_SHAPE))
    result = {
        "same_tensor_object_grew": holders[0] is k_buffer and tuple(k_buffer.shape[:1]) == (16 * tokens_per_page,),
        "data_ptr_unchanged": k_buffer.data_ptr() == ptr,
        "moved_pages_carry_expert_bytes": kv.page_checksums()[8:] == expert_sums[8:][::-1],
        "kv_prefix_intact_after_grow": kv.page_checksums()[:8] == kv_sums,
        "host_copy_pinned_on_gpu_only": host_copy.is_pinned() == gpu,
    }
    k_buffer[8 * tokens_per_page:].fill_(-1.0)  # the KV now owns those pages
    backend.synchronize()
    result["resident_experts_intact"] = experts.page_checksums() == expert_sums[:8]
    result["new_kv_rows_written"] = bool((k_buffer[8 * tokens_per_page:] == -1.0).all())

    kv.regrow(k_buffer, (8 * tokens_per_page, *KV_ROW_SHAPE))
    backend.synchronize()
    back = [kv.pop_tail() for _ in range(8)]  # pages 8..15 in their original order
    experts.extend(back)
    expert_bytes[8 * g:].copy_(host_copy)  # restore = copy the pinned host copy back into the same VA
    backend.synchronize()
    result["experts_restored_exactly"] = experts.page_checksums() == expert_sums
    result["kv_prefix_intact_after_shrink"] = kv.page_checksums() == kv_sums
    for handle in experts.close() + kv.close():
        backend.release(handle)
    arena.close()
    counts = backend.live_counts()
    result["nothing_left_mapped_or_live"] = counts.mappings == counts.reservations == counts.handles == 0
    result["ok"] = all(result.values())
    return result
