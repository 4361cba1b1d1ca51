"""gpu_check section `resize_rollback` (issue 19 item 2): a remap whose publish fails after the new rows
were zeroed leaves every expert byte as it was.

An offload lends expert pages to the KV buffers (or the state buffers), and the glue zeroes the new KV
rows (`GrowablePool.resize`) or state slots (`GrowableStatePool.resize`) before SGLang's size copies are
published. Here the publish then fails, as it may on a server (`VAMP_SGLANG_FAULT=publish:1`), and the
rollback must leave the experts' bytes, the KV rows and the state rows exactly as before: the pages go
back under the expert tensors and those experts are copied back from the host copy. SGLang's objects are
stood in for by namespaces with the attributes the glue reads (this script may not import SGLang).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vamp_sglang.integration.memory.kv_pool import GrowablePool
from vamp_sglang.integration.memory.state_pool import GrowableStatePool, state_tensors
from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.repartition import Repartitioner
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores
from vamp_sglang.memory.state_buffers import GrowableStateBuffers, StateKind


class PublishFailed(RuntimeError):
    """The stand-in for SGLang refusing the new size after the new rows were zeroed."""


def check(backend: PageBackend, gpu: bool) -> dict:
    """A KV and a state offload whose publish fails after zeroing: experts, KV and state rows exact."""
    dev, dtype = backend.device, (torch.bfloat16 if gpu else torch.float32)
    experts, hidden, inter = (64, 1024, 512) if gpu else (16, 128, 64)
    gen = torch.Generator(device=dev).manual_seed(3)
    weights = {lid: (torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen, dtype=dtype),
                     torch.randn(experts, hidden, inter, device=dev, generator=gen, dtype=dtype)) for lid in (1, 2)}
    itemsize = torch.empty(0, dtype=dtype).element_size()
    layout = ExpertLayout.compute([0, 1, 2], experts, 2 * inter * hidden * itemsize, hidden * inter * itemsize,
                                  backend.granularity_bytes, 0.5, experts)
    before = backend.live_counts()
    staging, stores = build_expert_stores(backend, layout, weights)
    kv = GrowableKVBuffers.for_layout(backend, layout, 2, 8, 128, dtype, initial_rows=1024)
    pool = GrowablePool(SimpleNamespace(page_size=1, size=kv.row_capacity - 1), kv)
    for t in [*kv.k_buffers, *kv.v_buffers]:
        t.copy_(torch.randn(t.shape, device=dev, generator=gen, dtype=dtype))
    kinds = ([StateKind((4096, 3), torch.bfloat16), StateKind((16, 128, 128), torch.float32)] if gpu
             else [StateKind((256, 3), torch.float32), StateKind((4, 32, 32), torch.float32)])
    buffers = GrowableStateBuffers(backend, kinds, layers=2, initial_rows=5, max_rows=4096)
    states = GrowableStatePool(_mamba_stand_in(kinds, dev), buffers)
    for t in state_tensors(states.mamba_pool):
        t.copy_(torch.randn(t.shape, device=dev, generator=gen).to(t.dtype))

    def publish_kv(old_rows: int, new_rows: int, pool_tokens: int | None) -> None:
        tokens = pool.pool.size
        pool.resize(pool.size_for_rows(new_rows))  # zeroes the new rows, on pages the experts lent
        pool.resize(tokens, zero_new_rows=False)  # the glue's own undo, as after a failed publish
        raise PublishFailed("the scheduler refused the new KV pool size")

    def publish_state(old_rows: int, new_rows: int, rollback: bool) -> None:
        slots = states.slots
        states.resize(new_rows - 1)  # zeroes the new slots
        states.resize(slots)
        raise PublishFailed("the scheduler refused the new state pool size")

    rp = Repartitioner(layout, stores, kv, publish_kv, tail_is_free=lambda first, end: True, state=buffers,
                       on_state_resize=publish_state)
    expert_sums = [s.expert_checksums(0, experts) for s in stores]
    kv_rows, kv_sums, state_sums = kv.row_capacity, kv.checksums(), buffers.checksums()
    result: dict = {}
    for name, to_state in (("kv", False), ("state", True)):
        try:
            rp.offload(layout.bound_groups, pool_tokens=0, to_state=to_state)
            result[f"{name}_publish_failed"] = False
        except PublishFailed:
            result[f"{name}_publish_failed"] = True
        backend.synchronize()
        result[f"{name}_experts_exact"] = [s.expert_checksums(0, experts) for s in stores] == expert_sums
    result["kv_rows_as_before"] = kv.row_capacity == kv_rows and kv.checksums() == kv_sums
    result["state_rows_as_before"] = states.slots == 4 and buffers.checksums() == state_sums
    result["nothing_offloaded"] = rp.offloaded_groups == 0
    rp.close()
    kv.close()
    buffers.close()
    close_expert_stores(staging, stores)
    result["no_page_leaked"] = backend.live_counts() == before
    result["ok"] = all(result.values())
    return result


def _mamba_stand_in(kinds: list[StateKind], device: torch.device) -> SimpleNamespace:
    """What GrowableStatePool reads of SGLang's HybridReqToTokenPool: 4 slots (+ padding) over 2 layers."""
    conv, temporal = (torch.zeros((2, 5, *k.slot_shape), dtype=k.dtype, device=device) for k in kinds)
    mamba_pool = SimpleNamespace(size=4, mamba_cache=SimpleNamespace(conv=[conv], temporal=temporal))
    allocator = SimpleNamespace(free_slots=torch.arange(1, 5, device=device), size=4)
    return SimpleNamespace(mamba_pool=mamba_pool, mamba_allocator=allocator)
