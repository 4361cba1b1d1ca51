"""gpu_check section `compaction_probe` (issue 48, defect 5): one restore attempt's compaction probe over a
prefix tree of 50,000 small device index tensors (4 rows each), timed as the project runs it
(`compaction.used_tail_is_in`: one batched reduction, one host read) and as it ran before, kept here only
as the baseline: per node `bool(mask.any())` and `int(mask.sum())`, each a blocking device-to-host read.
Both must give the same answer, movable and not. On the host (no GPU) the same at 5,000 nodes."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from vamp_sglang.integration.memory.compaction import used_tail_is_in
from vamp_sglang.memory.backend import PageBackend

ROWS_PER_NODE = 4


def per_node_probe(allocator, values: list[torch.Tensor], keep_tokens: int) -> bool:
    """The probe before issue 48: one mask and two host reads per node (the baseline)."""
    free = allocator.get_all_free_pages()
    used_above = (int(allocator.size) - keep_tokens) - int((free > keep_tokens).sum())
    masks = [mask for mask in (value > keep_tokens for value in values) if bool(mask.any())]
    return used_above == sum(int(mask.sum()) for mask in masks)


def _best_s(probe, allocator, values, keep_tokens, device: torch.device) -> tuple[float, bool]:
    best, answer = float("inf"), None
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        answer = probe(allocator, values, keep_tokens)
        best = min(best, time.perf_counter() - start)
    return best, answer


def check(backend: PageBackend, gpu: bool) -> dict:
    """One restore attempt's compaction probe over 50,000 small device index tensors: batched (one read)
    against the per-node loop it replaced (two reads per node)."""
    device = backend.device
    nodes = 50_000 if gpu else 5_000
    pool_rows = 2 * nodes * ROWS_PER_NODE
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randperm(pool_rows, device=device, generator=gen) + 1  # row 0 is SGLang's padding slot
    values = [v.clone() for v in rows[: nodes * ROWS_PER_NODE].split(ROWS_PER_NODE)]  # one tensor per node
    free = rows[nodes * ROWS_PER_NODE:].sort().values
    allocator = SimpleNamespace(page_size=1, size=pool_rows, get_all_free_pages=lambda: free)
    keep = pool_rows // 2
    result: dict = {"nodes": nodes, "rows_per_node": ROWS_PER_NODE, "device": str(device)}
    held = next(i for i, value in enumerate(values) if int(value.max()) > keep)  # left out: used, not movable
    for case, probe_values in (("movable", values), ("not_movable", values[:held] + values[held + 1:])):
        batched_s, batched = _best_s(used_tail_is_in, allocator, probe_values, keep, device)
        loop_s, loop = _best_s(per_node_probe, allocator, probe_values, keep, device)
        result[case] = {"batched_ms": round(batched_s * 1e3, 3), "per_node_loop_ms": round(loop_s * 1e3, 3),
                        "answers_agree": batched == loop, "answer": batched}
    result["ok"] = (result["movable"]["answer"] is True and result["not_movable"]["answer"] is False
                    and result["movable"]["answers_agree"] and result["not_movable"]["answers_agree"])
    if gpu:  # the point of the fix: the per-node loop is one sync per node, the batched probe one per attempt
        result["ok"] &= result["movable"]["batched_ms"] < result["movable"]["per_node_loop_ms"]
    return result
