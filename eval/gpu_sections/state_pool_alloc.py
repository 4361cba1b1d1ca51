"""gpu_check section `state_pool_alloc` (issue 19 item 4): a hybrid model's state pool is laid over
growable pages on a nearly full device, and the KV pool's pages are created after it.

SGLang allocates the linear-attention state tensors with torch, then the KV pool, having sized the KV
pool with the state bytes counted once. `lay_state_pool_over_growable` re-points the state tensors at
pages of their own (`cuMemCreate`), which cannot reuse blocks torch's caching allocator keeps: unless
SGLang's allocation is given back to the driver first, the KV pool's pages no longer fit. Here a torch
ballast leaves room for the state bytes, the KV bytes and less than one more copy of the state; the
state tensors are allocated as SGLang does, laid over growable pages, and then the KV pages must all be
created. Without a GPU the same steps run on host pages, with no ballast: what is checked there is
that the state tensors hold no bytes when the state reservations are made. SGLang's objects are stood
in for by namespaces with the attributes the glue reads (this script may not import SGLang).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vamp_sglang.integration.memory.state_pool import lay_state_pool_over_growable, state_tensors
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers
from vamp_sglang.memory.layout import ExpertLayout

GIB = 1 << 30
CONV, SSM = ((4096, 3), torch.bfloat16), ((16, 128, 128), torch.float32)  # Qwen3-Next TP2: 24 KiB, 1 MiB a slot
KV_ROW = (8, 128)  # [kv heads, head dim] bf16: 2 KiB per token per layer


def check(backend: PageBackend, gpu: bool) -> dict:
    """State tensors re-pointed at growable pages on a nearly full device, then every KV page created."""
    layers, slots, kv_layers = (12, 160, 4) if gpu else (2, 8, 2)
    kv_rows = GIB // (2 * kv_layers * KV_ROW[0] * KV_ROW[1] * 2) if gpu else 256  # 1 GiB of K and V in all
    state_bytes = layers * (slots + 1) * sum(_slot_bytes(*kind) for kind in (CONV, SSM))
    kv_bytes = 2 * kv_layers * kv_rows * KV_ROW[0] * KV_ROW[1] * 2
    result: dict = {"state_gib": round(state_bytes / GIB, 3), "kv_gib": round(kv_bytes / GIB, 3)}
    ballast = _fill_device_but(state_bytes + kv_bytes + state_bytes // 2, result) if gpu else None
    before = backend.live_counts()
    req = _sglang_state_pool(layers, slots, backend.device)  # torch-allocated, as SGLang's MambaPool
    tensors, held, reserve = state_tensors(req.mamba_pool), [], backend.reserve

    def reserve_and_look(nbytes: int) -> int:
        held.append(sum(t.untyped_storage().nbytes() for t in tensors))
        return reserve(nbytes)

    states = kv = None
    backend.reserve = reserve_and_look
    try:
        states = lay_state_pool_over_growable(req, backend, _layout(backend))
        result["state_pool_laid_out"] = True
        backend.reserve = reserve
        kv = GrowableKVBuffers(backend, kv_layers, *KV_ROW, torch.bfloat16, initial_rows=kv_rows, max_rows=kv_rows)
        result["kv_pages_created"] = True
    except Exception as exc:  # noqa: BLE001 - the out-of-memory this section looks for, reported
        result.setdefault("state_pool_laid_out", False)
        result.setdefault("kv_pages_created", False)
        result["error"] = repr(exc)[:500]
    finally:
        backend.reserve = reserve
    result["sglang_allocation_given_back_first"] = bool(held) and set(held) == {0}
    result["same_tensor_objects_zeroed"] = states is not None and all(
        a is b and bool((a == 0).all()) for a, b in zip(state_tensors(req.mamba_pool), tensors, strict=True))
    for owner in (kv, states and states.buffers):
        if owner is not None:
            owner.close()
    del ballast
    if gpu:
        torch.cuda.empty_cache()
    result["no_page_leaked"] = backend.live_counts() == before
    result["ok"] = all(v for v in result.values() if isinstance(v, bool))
    return result


def _slot_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.empty(shape, dtype=dtype, device="meta").numel() * dtype.itemsize


def _fill_device_but(room_bytes: int, result: dict) -> torch.Tensor:
    """A torch allocation that leaves about `room_bytes` of the device free."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    ballast = torch.empty(max(free - room_bytes, 0), dtype=torch.uint8, device="cuda")
    result["free_gib_left"] = round(torch.cuda.mem_get_info()[0] / GIB, 3)
    return ballast


def _sglang_state_pool(layers: int, slots: int, device: torch.device) -> SimpleNamespace:
    """What lay_state_pool_over_growable reads of SGLang's HybridReqToTokenPool (MambaPool's plain layout)."""
    conv, temporal = (torch.zeros((layers, slots + 1, *shape), dtype=dtype, device=device) for shape, dtype in (CONV, SSM))
    cache = SimpleNamespace(conv=[conv], temporal=temporal, replayssm_d=None, replayssm_k=None, replayssm_g=None)
    mamba_pool = SimpleNamespace(size=slots, mamba_cache=cache, _raw=None, _slot_siblings=[])
    allocator = SimpleNamespace(free_slots=torch.arange(1, slots + 1, device=device), size=slots)
    return SimpleNamespace(mamba_pool=mamba_pool, mamba_allocator=allocator, size=slots)  # size: max requests


def _layout(backend: PageBackend) -> ExpertLayout:
    """A small MoE layout: the state reservations hold its offload bound's pages (address space only)."""
    gran = backend.granularity_bytes
    return ExpertLayout.compute([0, 1], 16, gran, gran, gran, 0.25, 16)
