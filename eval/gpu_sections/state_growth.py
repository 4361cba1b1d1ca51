"""gpu_check section `state`: a hybrid model's layer-strided linear-attention state tensors (Qwen3-Next TP2
shapes) as GrowableStateBuffers: every layer grows at its tail in place; SGLang's slot clear and copy
(`index_fill_`, `t[:, dst] = t[:, src]`) on the strided view; shrinking gives every page back."""

from __future__ import annotations

import torch

from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.state_buffers import GrowableStateBuffers, StateKind


def check(backend: PageBackend, gpu: bool) -> dict:
    """Layer-strided linear-attention state tensors (Qwen3-Next TP2 shapes) grow and shrink in place.
    Every layer grows at its tail; SGLang's slot clear and copy (`index_fill_`, `t[:, dst] = t[:, src]`)
    on the strided view."""
    kinds = [StateKind((4096, 3), torch.bfloat16), StateKind((16, 128, 128), torch.float32)]  # 24 KiB, 1 MiB
    state = GrowableStateBuffers(backend, kinds, layers=4, initial_rows=5, max_rows=64)
    conv, ssm = state.tensors
    ptrs = [t.data_ptr() for t in state.tensors]
    for t in state.tensors:
        for layer in range(4):
            t[layer].fill_(layer + 1.0)
    before = state.checksums()
    grow = state.pages_for(20) - state.pages_for(5)
    state.grow_to(20, [backend.create(backend.granularity_bytes) for _ in range(grow)])
    ssm[:, 5:].fill_(-1.0)
    ssm.index_fill_(1, torch.tensor([19], device=backend.device), 7.0)  # MambaPool.clear_slots
    conv[:, torch.tensor([18], device=backend.device)] = conv[:, torch.tensor([2], device=backend.device)]
    backend.synchronize()
    result = {
        "same_objects_same_addresses": [t.data_ptr() for t in state.tensors] == ptrs and ssm.shape[1] == 20,
        "old_rows_intact": state.checksums(5) == before,
        "layer_views_contiguous": all(t[layer].is_contiguous() for t in state.tensors for layer in range(4)),
        "slot_clear_hits_every_layer": bool((ssm[:, 19] == 7.0).all()) and bool((ssm[:, 18] == -1.0).all()),
        "slot_copy_per_layer": all(bool((conv[layer, 18] == layer + 1.0).all()) for layer in range(4)),
    }
    tail = ssm[3, 19].data_ptr()
    for handle in state.shrink_to(5):
        backend.release(handle)
    result["shrunk_exactly"] = state.checksums() == before and not backend.is_mapped(tail, 4)
    state.close()
    counts = backend.live_counts()
    result["nothing_left_mapped_or_live"] = counts.mappings == counts.reservations == counts.handles == 0
    result["ok"] = all(result.values())
    return result
