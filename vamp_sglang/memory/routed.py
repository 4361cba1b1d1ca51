"""Routed-only staging: copy just the offloaded experts a step's router selected (issue 12).

Paper IV-D stages a layer's whole offloaded region every step, whatever the router picks; with top-k of E
experts and T tokens only about 1-(1-k/E)^T of them are read (Fig. 11: large batches cover most of the
region, small ones little of it). Here, once the layer's top-k ids are known, only the selected offloaded
rows are copied from the host copy into their staging place, the tensor's own aliased rows, so the MoE
kernel reads the same addresses and (reading only routed experts) gives bit-identical output.

Host: the rows are found with `torch.unique` and copied as runs of consecutive experts. CUDA: the copy
list is built on the device from the device-resident top-k ids (`device_copy_list`: no host read, so it
can run inside a CUDA graph or between its segments without a sync); the glue hands it to SGLang's
paged-experts gather kernel, which reads the row count on the device (integration/staging/routed_gather.py).
"""

from __future__ import annotations

import torch

from vamp_sglang.memory.experts import ExpertStore


def expected_routed_fraction(top_k: int, experts: int, tokens: int) -> float:
    """Expected fraction of any expert set that T tokens with uniform top-k of E routing select:
    1 - (1 - k/E)^T (issue 12; paper Fig. 11 shows the same saturation with batch size)."""
    if tokens <= 0 or experts <= 0:
        return 0.0
    return 1.0 - (1.0 - min(top_k, experts) / experts) ** tokens


def host_offset(store: ExpertStore) -> int:
    """Expert id of host-copy row 0 (host rows hold experts [R - rows, R), R the routed experts)."""
    return store.routed_experts - store.host_w13.shape[0]


def routed_offloaded_runs(topk_ids: torch.Tensor, boundary: int, experts: int) -> list[tuple[int, int]]:
    """[first, end) runs of consecutive offloaded experts (ids in [boundary, E)) that some token selected;
    negative ids are padding."""
    ids = torch.unique(topk_ids.reshape(-1)).tolist()
    runs: list[tuple[int, int]] = []
    for e in ids:
        if boundary <= e < experts:
            if runs and runs[-1][1] == e:
                runs[-1] = (runs[-1][0], e + 1)
            else:
                runs.append((e, e + 1))
    return runs


def copy_routed_host(store: ExpertStore, runs: list[tuple[int, int]]) -> int:
    """Copy the runs' w13 and w2 rows from the host copy into the aliased offloaded rows; returns bytes."""
    offset, copied = host_offset(store), 0
    for dst, src in ((store.w13, store.host_w13), (store.w2, store.host_w2)):
        for first, end in runs:
            rows = dst[first:end]
            rows.copy_(src[first - offset:end - offset])
            copied += rows.numel() * rows.element_size()
    return copied


def device_copy_list(topk_ids: torch.Tensor, boundary: int, experts: int, offset: int,
                     src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor) -> None:
    """Write the routed offloaded experts into `dst` (absolute expert ids, int32), their host rows into
    `src` (= dst - offset) and how many there are into `count[0]`, entirely with device ops: no host read,
    fixed shapes for a given boundary, so it is CUDA-graph safe. `src`/`dst` hold at least E - boundary
    entries; entries past count are left as they are (the gather kernel reads only count of them)."""
    n_off = experts - boundary
    if n_off <= 0:
        count.zero_()
        return
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids = torch.where((ids >= boundary) & (ids < experts), ids - boundary, n_off)  # others -> sentinel
    selected = torch.zeros(n_off + 1, dtype=torch.bool, device=topk_ids.device)
    selected.index_fill_(0, ids, True)
    selected = selected[:n_off]
    count.copy_(selected.sum(dtype=torch.int32).reshape(1))
    order = torch.argsort((~selected).to(torch.int8), stable=True)  # the selected rows first, ascending
    dst[:n_off].copy_(order + boundary)
    src[:n_off].copy_(order + (boundary - offset))
