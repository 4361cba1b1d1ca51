"""CUDA graphs stay on while experts are offloaded (issue 10): the staging hook is SGLang's own
`eager_on_graph` break, so a graph captured with nothing offloaded replays correctly after `offload(n)`
with no re-capture. No GPU here, so the capture is a stand-in for `BreakableCUDAGraphCapture` (the
four members `eager_on_graph` uses) whose segments record Python closures the way a CUDA capture
records kernels; the wrapper, its capture-time run and its replay closure are SGLang's real code.
The same protocol on a real CUDA graph is checked by eval/gpu_check.py (section `graphs`)."""

from types import SimpleNamespace

import pytest
import torch
from test_experts import make_layout, make_weights
from test_staging import HIDDEN, LAYERS, TOKENS, TOP_K, model  # noqa: F401 (model: the paged stores)

from eval.bench_memory import moe_forward
from vamp_sglang.integration import moe_staging
from vamp_sglang.memory.staging import StagingEngine


class StandInCapture:
    """Segments of recorded work separated by eager breaks; `capturing` is what the stream would say."""

    def __init__(self):
        self.cuda_graph = SimpleNamespace(_break_fns=[])
        self._barrier_fn = None
        self.segments = [[]]
        self.capturing = True

    def _end_current_segment(self):
        self.capturing = False

    def _begin_new_segment(self):
        self.segments.append([])
        self.capturing = True

    def launch(self, kernel):
        """A kernel launch: recorded while capturing, run otherwise (break bodies, eager forwards)."""
        if self.capturing:
            self.segments[-1].append(kernel)
        else:
            kernel()

    def replay(self):
        for i, segment in enumerate(self.segments):
            for kernel in segment:
                kernel()
            if i < len(self.cuda_graph._break_fns):
                self.cuda_graph._break_fns[i]()


@pytest.fixture
def graph_model(model):  # noqa: F811 (the fixture imported above)
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import breakable_cuda_graph

    backend, weights, layout, stores = model
    capture = StandInCapture()
    capture.capturing = False
    engine = StagingEngine(stores, "async", is_capturing=lambda: capture.capturing)
    layers = {s.layer_id: SimpleNamespace(layer_id=s.layer_id) for s in stores}
    experts = moe_staging.ModelExperts(backend, layout, None, stores, engine, layers)
    yield SimpleNamespace(backend=backend, weights=weights, layout=layout, stores=stores, experts=experts,
                          capture=capture, capture_var=breakable_cuda_graph._current_capture_var)
    engine.close()


def forward(m, state):
    """The model: residual MoE layers; eligible layers go through our run_moe_core hook."""
    tensors = {lid: w[:2] for lid, w in m.weights.items()} | {s.layer_id: (s.w13, s.w2) for s in m.stores}

    for lid in LAYERS:
        def kernel(lid=lid):
            state["x"] = state["x"] + moe_forward(state["x"], m.weights[lid][2], *tensors[lid], TOP_K)

        layer = m.experts.layers.get(lid, SimpleNamespace(layer_id=lid))
        moe_staging.run_moe_core_staged(m.experts, lambda _layer, k=kernel: m.capture.launch(k), layer)


def offload(m, groups):
    for store in m.stores:
        for handle in store.offload_tail_pages(groups):
            m.backend.release(handle)


def test_a_graph_captured_before_offload_replays_exactly_after_it(graph_model):
    m = graph_model
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(12))
    reference = {"x": x.clone()}
    forward(m, reference)  # eager, nothing offloaded: the unpaged result
    static = {"x": x.clone()}  # the graph's static input/output buffer
    token = m.capture_var.set(m.capture)  # what BreakableCUDAGraphCapture.__enter__ sets
    m.capture.capturing = True
    try:
        forward(m, static)
        m.capture._end_current_segment()
    finally:
        m.capture_var.reset(token)
    assert len(m.capture.cuda_graph._break_fns) == len(m.stores) == moe_staging.staging_breaks(m.experts)
    assert [len(seg) for seg in m.capture.segments] == [1, 1, 1, 1]  # a break before each eligible MoE
    assert m.experts.engine.stats().copies == 0

    for groups in (4, 20):  # the boundary moves twice; the graph is never captured again
        offload(m, groups - m.stores[0].offloaded_groups)
        for store in m.stores:  # stale slots: only the breaks' staging copies can fix them
            for dst, _ in store.staging_pairs():
                dst.fill_(float("nan"))
        static["x"] = x.clone()
        m.experts.engine.begin_forward()  # the _forward_raw hook runs eagerly before every replay
        m.capture.replay()
        assert torch.equal(static["x"], reference["x"])  # NaN if the breaks did not stage
    assert m.experts.engine.stats().copies == 2 * len(m.stores)


def test_no_breaks_when_nothing_can_leave():
    weights = make_weights([0, 1], 8, 128, 64)
    layout = make_layout(weights, 0.1)  # bound 0 groups
    experts = SimpleNamespace(layout=layout, layers={1: object()})
    assert layout.bound_groups == 0 and moe_staging.staging_breaks(experts) == 0
    assert moe_staging.staging_breaks(None) == 0
