"""CUDA graphs stay on while experts are offloaded (issue 10): the staging hook is SGLang's own
`eager_on_graph` break, so a graph captured with nothing offloaded replays correctly after `offload(n)`
with no re-capture. No GPU here, so the capture is a stand-in for `BreakableCUDAGraphCapture` (the
four members `eager_on_graph` uses) whose segments record Python closures the way a CUDA capture
records kernels; the wrapper, its capture-time run and its replay closure are SGLang's real code.
The same protocol on a real CUDA graph is checked by eval/gpu_check.py (section `graphs`)."""

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch
from test_experts import make_layout, make_weights
from test_staging import HIDDEN, LAYERS, TOKENS, TOP_K, model  # noqa: F401 (model: the paged stores)

from eval.bench_memory import moe_forward
from vamp_sglang.integration.staging import moe_staging
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


def two_gemm_moe(x, router, w13, w2, gemm):
    """`moe_forward`'s math launched the way SGLang's Triton MoE does: one gate-up GEMM over every routed
    (token, expert) pair, then one down GEMM, each through `gemm(b, kernel)`, the `invoke_fused_moe_kernel`
    call whose second argument is the weight it reads."""
    act = {}

    def gate_up():  # the router runs in the same segment (a captured kernel reads the live input)
        weights, ids = torch.topk(torch.softmax(x() @ router.T, dim=-1), TOP_K, dim=-1)
        act["ids"], act["weights"] = ids, weights / weights.sum(dim=-1, keepdim=True)
        gate, up = torch.einsum("tkoh,th->tko", w13[ids], x()).chunk(2, dim=-1)
        act["h"] = torch.nn.functional.silu(gate) * up

    def down():
        return torch.einsum("tkhi,tki,tk->th", w2[act["ids"]], act["h"], act["weights"])

    gemm(w13, gate_up)
    return gemm(w2, down)


def test_split_waits_run_the_gate_up_gemm_while_w2_is_copying_in_a_replayed_graph(graph_model):
    """Issue 10 item 6 (paper V-B): a graph captured with nothing offloaded, replayed after offload with
    split waits: each eligible layer's gate-up GEMM runs before its w2 copy may finish (the copy is held
    until the first eligible gate-up ran; a joint wait would block on it), the down GEMM waits for w2 at a
    second break, and the result is bit for bit the unpaged one."""
    from test_staging import GatedW2Engine

    m = graph_model
    gate = threading.Event()
    engine = GatedW2Engine(m.stores, "async", split_w2_wait=True, gate=gate,
                           is_capturing=lambda: m.capture.capturing)
    experts = dataclasses.replace(m.experts, engine=engine,
                                  w2_owners={s.w2.data_ptr(): s.layer_id for s in m.stores})
    tensors = {s.layer_id: (s.w13, s.w2) for s in m.stores}
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(13))

    def forward_two_gemm(state, paged):
        for lid in LAYERS:
            w13, w2 = tensors[lid] if paged and lid in tensors else m.weights[lid][:2]

            def gemm(b, kernel, lid=lid):
                def launch():
                    out = kernel()
                    if paged and kernel.__name__ == "gate_up" and lid in experts.layers:
                        # the held w2 copy may complete 0.2 s later: an unwaited down GEMM reads NaN.
                        # Only the replayed (paged) forward opens the gate: a timer left by the
                        # reference forward could open it early and hide a w2 break that waits for nothing
                        threading.Timer(0.2, gate.set).start()
                    return out
                return moe_staging.invoke_fused_moe_kernel_staged(experts, lambda _a, _b: m.capture.launch(launch),
                                                                  None, b)

            def moe_core(_layer, lid=lid, w13=w13, w2=w2):
                def residual(b, kernel):
                    if kernel.__name__ != "down":
                        return gemm(b, kernel)
                    return gemm(b, lambda: state.__setitem__("x", state["x"] + kernel()))
                two_gemm_moe(lambda: state["x"], m.weights[lid][2], w13, w2, residual)

            moe_staging.run_moe_core_staged(experts, moe_core, experts.layers.get(lid, SimpleNamespace(layer_id=lid)))

    reference = {"x": x.clone()}
    forward_two_gemm(reference, paged=False)
    static = {"x": x.clone()}
    token = m.capture_var.set(m.capture)
    m.capture.capturing = True
    try:
        forward_two_gemm(static, paged=True)
        m.capture._end_current_segment()
    finally:
        m.capture_var.reset(token)
    assert len(m.capture.cuda_graph._break_fns) == 2 * len(m.stores) == moe_staging.staging_breaks(experts)
    assert [len(seg) for seg in m.capture.segments] == [2] + [1] * (2 * len(m.stores))

    offload(m, 20)
    for store in m.stores:
        for dst, _ in store.staging_pairs():
            dst.fill_(float("nan"))
    static["x"] = x.clone()
    gate.clear()
    engine.begin_forward()
    m.capture.replay()
    assert torch.equal(static["x"], reference["x"])
    assert engine.missed_w2_waits == 0 and engine.split_w2_wait
    engine.close()


def test_split_waits_only_where_sglang_runs_the_triton_moe():
    """Only SGLang's Triton MoE runs the down GEMM as its own `invoke_fused_moe_kernel` call; every other
    path would read w2 unwaited, so one such layer turns the split off for the model."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    def layer(backend, **flags):
        return SimpleNamespace(quant_method=SimpleNamespace(runner=SimpleNamespace(runner_backend=backend),
                                                            _aiter_runner=None, **flags))

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton = [layer(MoeRunnerBackend.TRITON), layer(MoeRunnerBackend.TRITON)]
    assert moe_staging.splits_w2_wait(triton, cuda)
    assert not moe_staging.splits_w2_wait(triton, cpu)  # SGLang's CPU MoE loops experts, w13 and w2 together
    assert not moe_staging.splits_w2_wait(triton + [layer(MoeRunnerBackend.FLASHINFER_TRTLLM)], cuda)
    assert not moe_staging.splits_w2_wait(triton + [layer(MoeRunnerBackend.TRITON, use_flashinfer_cutlass=True)],
                                          cuda)
    assert not moe_staging.splits_w2_wait([SimpleNamespace(quant_method=SimpleNamespace())], cuda)
