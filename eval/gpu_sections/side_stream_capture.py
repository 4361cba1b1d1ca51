"""A breakable-style decode graph over MoE blocks that fork their experts onto a side stream while
capturing (issue 19 item 1), on a real GPU, with torch only (gpu_check imports no SGLang).

SGLang's Qwen2-MoE / Qwen3-Next block (models/qwen2_moe.py:833-848, 763-791) and GLM-4-MoE block
(models/glm4_moe.py:573-601) run the router and the routed experts inside
`with torch.cuda.stream(self.alt_stream)` while capturing, so a staging break there would end the graph
segment on the side stream. `Capture` follows SGLang's breakable capture
(runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py): a break joins the side streams still
in the capture into the capture stream, ends the segment on the current stream (`capture_end`, which
torch ends on the current stream), runs its body eagerly and begins the next segment on the current
stream (:272-315, :447-455); replay is segment, break, segment, ... on the current stream (:332-341).
`DualStreamBlock` is the blocks' fork and join. The section checks that:

- the hazard is real on this GPU: with the side stream left in place the capture fails;
- with `keep_moe_on_capture_stream` (what `convert_experts` applies) the capture succeeds with one break
  per eligible layer while the resident first layer still forks and joins inside its segment, and a replay
  after offload over stale staging slots equals, bit for bit in bf16, the replay of the same graph with
  nothing offloaded. Both sides run the same captured kernels, so a cuBLAS choice under capture that
  differs from eager mode cannot fail the comparison; a replay without the breaks reads the stale slots
  (NaN), so the comparison can fail.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eval.gpu_sections.toy_moe import fill_slots, routed_moe, toy_layers
from vamp_sglang.integration.staging.moe_staging import keep_moe_on_capture_stream
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores

EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 64, 512, 256, 8, 4  # 2 MiB pages: a group is 8 experts, bound 4
LAYER_IDS = [0, 1, 2]  # the first MoE layer stays resident (no break)


class Capture:
    """Graph segments separated by eager breaks, captured on `stream` (SGLang's breakable capture)."""

    def __init__(self, side_streams: list[torch.cuda.Stream]) -> None:
        self.stream = torch.cuda.Stream()  # a graph cannot be captured on the default stream
        self.side_streams = side_streams
        self.pool = torch.cuda.graph_pool_handle()
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[Callable[[], None]] = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capture_mode = False  # SGLang's get_is_capture_mode(): true in the warm-ups and the capture

    @property
    def capturing(self) -> bool:
        return self.graph is not None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        for side in self.side_streams:  # join the forked side streams still in the capture
            with torch.cuda.stream(side):
                joined = torch.cuda.is_current_stream_capturing()
            if joined:
                self.stream.wait_stream(side)
        self.graph.capture_end()
        self.segments.append(self.graph)
        self.graph = None

    def brk(self, body: Callable[[], None]) -> None:
        """`eager_on_graph`: a plain call outside a capture; inside, end the segment, run, begin anew."""
        if not self.capturing:
            body()
            return
        self.end()
        body()
        self.breaks.append(body)
        self.begin()

    def abort(self) -> None:
        """End a failed capture on the capture stream, so the GPU is usable again."""
        if self.graph is not None:
            with torch.cuda.stream(self.stream):
                try:
                    self.graph.capture_end()
                except RuntimeError:
                    pass
            self.graph = None

    def replay(self, breaks: bool = True) -> None:
        for i, segment in enumerate(self.segments):
            segment.replay()
            if breaks and i < len(self.breaks):
                self.breaks[i]()


class RoutedExperts(torch.nn.Module):
    """The FusedMoE layer: the staging break (eligible layers), then the capturable routed MoE."""

    def __init__(self, layer_id: int, weights: tuple, capture: Capture, engine: StagingEngine | None,
                 moe: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.layer_id, self.weights, self.capture, self.engine, self.moe = layer_id, weights, capture, engine, moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.engine is not None:
            self.capture.brk(lambda engine=self.engine, lid=self.layer_id: engine.before_moe(lid))
        w13, w2, router = self.weights
        return self.moe(x, router, w13, w2, TOP_K)


class DualStreamBlock(torch.nn.Module):
    """The MoE block: in capture mode and given an `alt_stream`, the shared expert runs on the current
    stream and the routed experts on `alt_stream`, joined before the sum (qwen2_moe.py:763-791)."""

    def __init__(self, experts: RoutedExperts, shared: torch.Tensor, alt_stream: torch.cuda.Stream) -> None:
        super().__init__()
        self.experts, self.shared, self.alt_stream = experts, shared, alt_stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.alt_stream is not None and self.experts.capture.capture_mode:
            current = torch.cuda.current_stream()
            self.alt_stream.wait_stream(current)
            shared = x @ self.shared
            with torch.cuda.stream(self.alt_stream):
                routed = self.experts(x)
            current.wait_stream(self.alt_stream)
        else:
            shared = x @ self.shared
            routed = self.experts(x)
        return x + routed + shared


def _model(weights: dict, paged: dict, shared: dict, engine: StagingEngine,
           moe: Callable[..., torch.Tensor]) -> tuple[torch.nn.ModuleList, Capture]:
    """The MoE blocks of LAYER_IDS over one side stream, the eligible ones reading the paged experts."""
    alt = torch.cuda.Stream()
    capture = Capture([alt])
    blocks = torch.nn.ModuleList(
        DualStreamBlock(RoutedExperts(lid, paged.get(lid, weights[lid]), capture,
                                      engine if lid in paged else None, moe), shared[lid], alt)
        for lid in LAYER_IDS)
    return blocks, capture


def _capture(blocks: torch.nn.ModuleList, capture: Capture, engine: StagingEngine, static: torch.Tensor
             ) -> torch.Tensor:
    """Two eager warm-ups in capture mode (so the side stream is warmed up too, as SGLang's are), then the
    capture of one forward; returns its (graph-owned) output."""
    capture.capture_mode = True
    with torch.cuda.stream(capture.stream):
        for _ in range(2):
            engine.begin_forward()
            x = static
            for block in blocks:
                x = block(x)
        capture.begin()
        x = static
        for block in blocks:
            x = block(x)
        capture.end()
    capture.capture_mode = False
    torch.cuda.synchronize()
    return x


def _replay(capture: Capture, engine: StagingEngine, static: torch.Tensor, x0: torch.Tensor, out: torch.Tensor,
            breaks: bool = True) -> torch.Tensor:
    static.copy_(x0)
    engine.begin_forward()  # SGLang's forward hook runs eagerly before every replay
    capture.replay(breaks)
    return out.clone()


def check(backend, gpu: bool) -> dict:
    """A breakable-style graph over MoE blocks forking experts to a side stream: capture fails unless kept on the capture stream; replay exact."""
    dev, dtype = backend.device, torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(19)
    before = backend.live_counts()
    weights, layout = toy_layers(backend, LAYER_IDS, EXPERTS, HIDDEN, INTER, dtype, gen)
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    engine = StagingEngine(stores, "async")
    paged = {s.layer_id: (s.w13, s.w2, weights[s.layer_id][2]) for s in stores}
    shared = {lid: torch.randn(HIDDEN, HIDDEN, device=dev, generator=gen, dtype=dtype) / HIDDEN for lid in LAYER_IDS}
    x0 = torch.randn(TOKENS, HIDDEN, device=dev, generator=gen, dtype=dtype)
    result: dict = {"offloadable_groups": layout.bound_groups}

    blocks, capture = _model(weights, paged, shared, engine, routed_moe)
    keep_moe_on_capture_stream(blocks, [b.experts for b in blocks[1:]])
    result["only_eligible_blocks_lost_their_side_stream"] = (
        blocks[0].alt_stream is not None and all(b.alt_stream is None for b in blocks[1:]))
    static = x0.clone()
    out = _capture(blocks, capture, engine, static)
    result["one_break_per_eligible_layer"] = len(capture.breaks) == len(stores)
    reference = _replay(capture, engine, static, x0, out)  # nothing offloaded: the same kernels as below
    groups = layout.bound_groups
    for store in stores:
        for handle in store.offload_tail_pages(groups):
            backend.release(handle)
    fill_slots(stores, float("nan"))
    result["stale_slots_read_without_the_breaks"] = bool(
        torch.isnan(_replay(capture, engine, static, x0, out, breaks=False)).any())
    engine.drain()  # the forward-start prefetch that replay issued must not count for the next one
    fill_slots(stores, float("nan"))
    replayed = _replay(capture, engine, static, x0, out)
    result["replay_after_offload_equals_replay_before"] = torch.equal(replayed, reference)
    result["replay_max_abs_diff"] = float((replayed.float() - reference.float()).abs().max())
    result["replay_again_exact"] = torch.equal(_replay(capture, engine, static, x0, out), reference)

    # The negative control, last: the same model with the side stream left in place (before the fix).
    blocks, capture = _model(weights, paged, shared, engine, routed_moe)
    try:
        _capture(blocks, capture, engine, x0.clone())
        result["side_stream_break_fails_capture"] = False
    except RuntimeError as exc:
        capture.abort()
        torch.cuda.synchronize()
        result["side_stream_break_fails_capture"] = True
        result["side_stream_error"] = str(exc).strip().splitlines()[0][:300]

    for store in stores:
        store.restore_tail(None, groups)
    engine.close()
    close_expert_stores(staging, stores)
    result["no_page_leaked"] = backend.live_counts() == before
    result["ok"] = all(v for v in result.values() if isinstance(v, bool))
    return result
