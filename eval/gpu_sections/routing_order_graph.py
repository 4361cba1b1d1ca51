"""gpu_check section `routing_order`: residency by routing (issue 49, `--vamp-expert-order routing`,
memory/residency.py) inside a captured CUDA graph. The router, `Residency.route` (decayed counts and the
logical -> physical id map, applied in place to the top-k ids) and an MoE that reads the rows the ids name
are captured once; then a reorder swaps every offloadable row with a resident one (rows, host copies and
the device map together, journalled) and the same graph is replayed without a re-capture:

- `replay_after_swap_equals_replay_before`: bit for bit (the same kernels over the same weights, read at
  their new rows), and again after the journal's rollback (`replay_after_rollback_equals_before`);
- `unmapped_replay_differs_after_swap`: the control, a graph captured without the map reads the swapped
  rows under the old ids, so the swap did move what the kernel reads;
- `replay_close_to_eager` within bf16 tolerance (graph against eager: other kernels may be chosen);
- `counts_advance_in_replay`: the counts, observed inside the graph, grow at each replay;
- eager forwards before and after the swap bit for bit (`eager_after_swap_exact`), the map a permutation;
- `padding_rows_not_counted`: told a real count of 9 tokens (decode at batch 9 replays the 16-row graph),
  a replay of the graph captured with every row real counts 9 x k selections, exactly those of rows [:9].

Without a GPU the eager parts run in float32 on host memory (no capture)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.journal import Journal
from vamp_sglang.memory.residency import ExpertRows, Residency

BF16_TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-2}


def gathered_moe(x: torch.Tensor, gates: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
    """SiLU-gated experts at the rows the ids name, one top-k slot at a time over per-token gathered
    weights (fixed shapes, no host read: capturable). A -1 id reads row 0 with weight 0, as a kernel
    that skips it adds nothing; every other row read is a routed one."""
    out = torch.zeros_like(x)
    skipped = ids < 0
    gates, ids = gates.masked_fill(skipped, 0).to(x.dtype), ids.clamp_min(0)
    for k in range(ids.shape[1]):
        gate, up = torch.bmm(w13[ids[:, k]], x[:, :, None])[..., 0].chunk(2, dim=-1)
        out += gates[:, k, None] * torch.bmm(w2[ids[:, k]], (F.silu(gate) * up)[:, :, None])[..., 0]
    return out


def check(backend: PageBackend, gpu: bool) -> dict:
    """The logical -> physical id map of residency by routing inside a captured CUDA graph: replays after a
    reorder and after its rollback equal the replay before, bit for bit."""
    dev, dtype = backend.device, (torch.bfloat16 if gpu else torch.float32)
    experts, hidden, inter, top_k, tokens = (64, 512, 256, 4, 16) if gpu else (16, 64, 32, 2, 8)
    gen = torch.Generator(device=dev).manual_seed(7)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen, dtype=dtype) / 32
    w2 = torch.randn(experts, hidden, inter, device=dev, generator=gen, dtype=dtype) / 16
    router = torch.randn(experts, hidden, device=dev, generator=gen, dtype=dtype)
    half = experts // 2  # the offloadable rows, with host copies as an ExpertStore keeps them
    residency = Residency([ExpertRows([w13, w2], [w13[half:].cpu().clone(), w2[half:].cpu().clone()], experts)], dev)
    x = torch.randn(tokens, hidden, device=dev, generator=gen, dtype=dtype)

    def routes() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(torch.softmax(x.float() @ router.float().T, dim=-1), top_k)

    def forward(mapped: bool = True) -> torch.Tensor:
        gates, ids = routes()
        if mapped:
            residency.route(0, ids)
        return gathered_moe(x, gates, ids, w13, w2)

    eager_before = forward()
    graphs = (_capture(forward, True), _capture(forward, False)) if gpu else None
    replay_before = [_replay(g) for g in graphs] if gpu else None
    counts = torch.zeros(1, experts)
    counts[0, half:] = torch.arange(1, experts - half + 1, dtype=torch.float32)  # the offloadable rows hottest
    journal = Journal()
    moved = residency.reorder(journal, experts, half, counts)
    result = {"swaps": residency.swaps, "swapped_bytes": moved,
              "map_is_a_permutation": sorted(residency.order.device_map[0].tolist()) == list(range(experts))
              and residency.order.physical_of(0) != list(range(experts)),
              "eager_after_swap_exact": torch.equal(forward(), eager_before)}
    if gpu:
        before = residency.counts._counts.sum().item()
        after = [_replay(g) for g in graphs]
        result.update(replay_after_swap_equals_replay_before=torch.equal(after[0], replay_before[0]),
                      unmapped_replay_differs_after_swap=not torch.equal(after[1], replay_before[1]),
                      replay_close_to_eager=torch.allclose(after[0], eager_before, **BF16_TOLERANCE),
                      replay_max_abs_diff=float((after[0].float() - eager_before.float()).abs().max()),
                      counts_advance_in_replay=residency.counts._counts.sum().item() > before)
    journal.rollback()
    result["rollback_restores_the_identity"] = residency.order.physical_of(0) == list(range(experts))
    if gpu:
        result["replay_after_rollback_equals_before"] = torch.equal(_replay(graphs[0]), replay_before[0])
    real = tokens // 2 + 1
    logical = routes().indices[:real]
    step = (lambda: _replay(graphs[0])) if gpu else forward
    result["padding_rows_not_counted"] = _counts_real_rows_only(residency, step, logical, experts)
    result["ok"] = all(v for v in result.values() if isinstance(v, bool)) and result["swaps"] == experts - half
    return result


def _counts_real_rows_only(residency: Residency, step, real_ids: torch.Tensor, experts: int) -> bool:
    """One step told its real rows (`real_ids`' count) in the rows of the captured batch: the counts
    hold exactly the real rows' selections, none of the padding's."""
    residency.counts.reset()
    residency.counts.set_real_tokens(real_ids.shape[0])
    step()
    residency.counts.set_real_tokens(None)
    expected = torch.bincount(real_ids.reshape(-1).cpu(), minlength=experts).float()
    return torch.equal(residency.counts.agreed()[0], expected)


def _capture(forward, mapped: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch requires
        forward(mapped)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(mapped)
    torch.cuda.synchronize()
    return graph, out


def _replay(captured: tuple[torch.cuda.CUDAGraph, torch.Tensor]) -> torch.Tensor:
    graph, out = captured
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()
