"""Staging breaks run on the capture stream, also in models whose MoE block forks its experts onto a
side stream while capturing (issue 19 item 1).

Qwen2-MoE and Qwen3-Next (`Qwen2MoeSparseMoeBlock.forward_normal_dual_stream`) and GLM-4-MoE
(`Glm4MoeSparseMoeBlock.forward_normal_dual_stream`) run the router and the FusedMoE layer inside
`with torch.cuda.stream(self.alt_stream)` whenever `get_is_capture_mode()` holds. A staging break there
would end the graph segment on the side stream, and CUDA fails the capture (`cudaErrorStreamCaptureUnjoined`).
No GPU here, so the streams are stand-ins: `torch.cuda.current_stream` / `torch.cuda.stream` over a stack
of named streams, and a stand-in capture that, as CUDA does, fails when a segment ends or begins on a
stream other than the capture stream. The MoE blocks, their FusedMoE layers, `convert_experts`, SGLang's
`eager_on_graph` wrapper and its breakable-graph flag are the real ones. eval/gpu_check.py (section
`side_stream_capture`) captures the same shape of forward on a real CUDA graph."""

import contextlib

import pytest
import torch
from test_integration_memory import sglang_moe  # noqa: F401 (the fixture: dist groups for SGLang layers)
from test_staging_graphs import StandInCapture

from vamp_sglang.integration.staging import moe_staging
from vamp_sglang.memory.host_backend import HostPageBackend

HIDDEN, INTER, EXPERTS, TOP_K, MOE_LAYERS = 64, 32, 8, 2, 3
PAGE_BYTES = 4096  # w13 shard 16 KiB, w2 8 KiB: a group is one expert


class Stream:
    """What the models call on a stream: fork (`wait_stream`) and join are ordering only."""

    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass

    def __repr__(self):
        return f"Stream({self.name})"


class Streams:
    """`torch.cuda.current_stream` and `torch.cuda.stream` over a stack of stand-in streams."""

    def __init__(self, capture_stream):
        self.stack = [capture_stream]

    def current_stream(self, device=None):
        return self.stack[-1]

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:  # torch.cuda.stream(None) leaves the current stream as it is
            yield
            return
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()


class StreamCheckedCapture(StandInCapture):
    """A capture whose segments must end and begin on the capture stream, as CUDA requires."""

    def __init__(self, streams, stream):
        super().__init__()
        self.streams, self.stream = streams, stream

    def _end_current_segment(self):
        current = self.streams.current_stream()
        assert current is self.stream, f"a graph segment ended on {current}, the capture stream is {self.stream}"
        super()._end_current_segment()

    def _begin_new_segment(self):
        current = self.streams.current_stream()
        assert current is self.stream, f"a graph segment began on {current}, the capture stream is {self.stream}"
        super()._begin_new_segment()


def qwen2_moe_block(layer_id, alt_stream):
    """Qwen2-MoE's block, which Qwen3-Next uses too (models/qwen3_next.py imports it)."""
    from sglang.srt.models.qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, shared_expert_intermediate_size=0,
                            num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True)
    return Qwen2MoeSparseMoeBlock(layer_id=layer_id, config=config, quant_config=None, alt_stream=alt_stream)


def glm4_moe_block(layer_id, alt_stream):
    from sglang.srt.models.glm4_moe import Glm4MoeSparseMoeBlock
    from transformers import Glm4MoeConfig

    config = Glm4MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=1, topk_group=1)
    return Glm4MoeSparseMoeBlock(config=config, layer_id=layer_id, quant_config=None, alt_stream=alt_stream)


@pytest.fixture
def capture_run(sglang_moe, monkeypatch):  # noqa: F811 (the fixture imported above)
    """`run(blocks)`: convert the blocks' experts, then run each block once inside a stand-in breakable
    capture whose stream is `capture`; returns the capture."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import breakable_cuda_graph
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
        enable_breakable_cuda_graph,
    )

    capture_stream = Stream("capture")
    streams = Streams(capture_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", streams.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", streams.stream)
    opened = []

    def run(model, after_convert=lambda model: None):
        experts = moe_staging.convert_experts(model, HostPageBackend("cpu", granularity_bytes=PAGE_BYTES), 0.5)
        opened.append(experts)
        after_convert(model)
        original = FusedMoE.run_moe_core
        monkeypatch.setattr(FusedMoE, "run_moe_core", lambda layer, *a, **k: moe_staging.run_moe_core_staged(
            experts, original, layer, *a, **k))
        capture = StreamCheckedCapture(streams, capture_stream)
        x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(3))
        # what BreakableCUDAGraphCapture.__enter__ sets, and the flag the runner sets around it
        tokens = (breakable_cuda_graph._current_capture_var.set(capture),
                  breakable_cuda_graph._current_stream_var.set(capture_stream))
        try:
            with enable_breakable_cuda_graph(), torch.no_grad():
                for block in model:
                    block(x)
        finally:
            breakable_cuda_graph._current_stream_var.reset(tokens[1])
            breakable_cuda_graph._current_capture_var.reset(tokens[0])
        assert streams.stack == [capture_stream]
        return capture, experts

    yield run
    for experts in opened:
        experts.close()


@pytest.mark.parametrize("make_block", [qwen2_moe_block, glm4_moe_block])
def test_every_staging_break_of_a_dual_stream_model_runs_on_the_capture_stream(capture_run, make_block):
    model = torch.nn.ModuleList(make_block(i, Stream("alt")) for i in range(MOE_LAYERS))
    capture, experts = capture_run(model)
    assert experts.layout.bound_groups > 0
    assert len(capture.cuda_graph._break_fns) == moe_staging.staging_breaks(experts) == MOE_LAYERS - 1
    assert model[0].alt_stream is not None  # the resident first layer has no break and keeps its overlap


@pytest.mark.parametrize("make_block", [qwen2_moe_block, glm4_moe_block])
def test_a_break_on_a_side_stream_is_refused_before_cuda_sees_it(capture_run, make_block):
    """A model that forks its experts in a way the conversion does not know: the break names the layer
    instead of leaving CUDA to fail the capture at its end."""
    model = torch.nn.ModuleList(make_block(i, Stream("alt")) for i in range(MOE_LAYERS))

    def fork_again(model):
        for block in model:
            block.alt_stream = Stream("alt")

    with pytest.raises(moe_staging.SideStreamBreakError, match="MoE layer 1.s staging break runs on Stream\\(alt\\)"):
        capture_run(model, after_convert=fork_again)
