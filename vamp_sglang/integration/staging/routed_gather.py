"""Routed-only staging on CUDA through SGLang's paged-experts gather kernel (issue 12).

The copy list (routed offloaded experts -> their host rows) is built on the device from the router's
device-resident top-k ids (`memory.routed.device_copy_list`), and SGLang's `paged_experts_gather` reads
its length on the device, so the routed copy needs no host sync: it runs inside the staging break of a
breakable CUDA graph at every replay (or inside a full graph), on the compute stream, right before the
layer's MoE kernel. The gather writes the expert tensors' own rows (`gpu[dst*row] = host[src*row]`), the
addresses already aliased onto the staging slot, reading the pinned host copy through its UVA pointer.
Written without a GPU at hand; eval/gpu_check.py's `routed` section exercises the copy list and,
where SGLang is installed, this gather.
"""

from __future__ import annotations

import torch

from vamp_sglang.memory.experts import ExpertStore
from vamp_sglang.memory.routed import device_copy_list, host_offset


class GatherCopier:
    """`(store, topk_ids) -> device int32[1] row count`: the StagingEngine's routed copier on CUDA."""

    def __init__(self, stores: list[ExpertStore]) -> None:
        from sglang.kernels.ops.moe.paged_experts import (
            paged_experts_gather,
            paged_experts_host_device_pointer,
        )

        self._gather = paged_experts_gather
        self._plans: dict[int, tuple[torch.Tensor, ...]] = {}
        for store in stores:
            device = store.w13.device
            hosts = [paged_experts_host_device_pointer(h) for h in (store.host_w13, store.host_w2)]
            # gpu[dst[i] * row] with dst an absolute expert id: the table starts at expert 0
            gpus = [store.w13.data_ptr(), store.w2.data_ptr()]
            row_bytes = [store.layout.w13_shard_bytes, store.layout.w2_shard_bytes]
            if any(b % 2 for b in row_bytes):
                raise ValueError(f"layer {store.layer_id}: expert rows of {row_bytes} bytes; the gather needs even")
            rows = store.host_w13.shape[0]
            self._plans[store.layer_id] = (
                torch.tensor(hosts, dtype=torch.int64, device=device),
                torch.tensor(gpus, dtype=torch.int64, device=device),
                torch.tensor(row_bytes, dtype=torch.int64, device=device),
                torch.zeros(rows, dtype=torch.int32, device=device),  # src: host rows
                torch.zeros(rows, dtype=torch.int32, device=device),  # dst: expert ids
                torch.zeros(1, dtype=torch.int32, device=device))  # count, read on the device
        for hosts, gpus, row_bytes, src, dst, count in self._plans.values():
            self._gather(hosts, gpus, row_bytes, src, dst, count)  # JIT-build now, not in a step (count 0)

    def __call__(self, store: ExpertStore, topk_ids: torch.Tensor) -> torch.Tensor:
        hosts, gpus, row_bytes, src, dst, count = self._plans[store.layer_id]
        device_copy_list(topk_ids, store.boundary_expert, store.routed_experts, host_offset(store), src, dst,
                         count)
        self._gather(hosts, gpus, row_bytes, src, dst, count)
        return count
