"""`--vamp-staging host` on a GPU (issue 49), every part the CUDA path shares, checked here on the CPU: the
in-place split for the kernel, the round trip's snapshot / D2H / host half / H2D / add over reused buffers
(through a stand-in for the CUDA copies that logs its calls), the two breaks through SGLang's real
`eager_on_graph` in a stand-in breakable capture replayed after offloads, and the launcher's refusal, which
now names only the MoE runners that do not skip -1 ids. The CUDA copies themselves: tests/
test_host_experts_cuda_gpu.py and eval/gpu_check.py section `host_experts`."""

import os
from types import SimpleNamespace

import pytest
import sglang.srt.environ  # noqa: F401 (sglang_binds_ranks reads it: SGLang's import, once, here)
import torch
from test_experts import host_backend
from test_host_experts import Combine, Dispatch, TopK
from test_residency import moe_with_ids
from test_staging import HIDDEN, LAYERS, TOP_K, model  # noqa: F401 (model: the paged stores)
from test_staging_graphs import StandInCapture

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError
from vamp_sglang.integration.staging import moe_staging
from vamp_sglang.integration.staging.host_experts import HostExpertStats
from vamp_sglang.integration.staging.host_experts_cuda import MIN_TOKENS, HostRoundTrip, mask_cold_
from vamp_sglang.memory.staging import StagingEngine


class LoggedCopies:
    """The CPU stand-in for CudaCopies: plain buffers, each copy done at once, every call logged."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def host_buffer(self, shape, dtype):
        self.log.append("host_buffer")
        return torch.full(shape, 7, dtype=dtype)  # stale contents: only a copy makes them right

    def device_buffer(self, shape, dtype):
        self.log.append("device_buffer")
        return torch.full(shape, 7, dtype=dtype)

    def refuse_capture(self):
        self.log.append("refuse_capture")

    def to_host(self, pairs):
        self.log.append("to_host")
        for dst, src in pairs:
            dst.copy_(src)

    def wait_host(self):
        self.log.append("wait_host")

    def to_device(self, dst, src):
        self.log.append("to_device")
        dst.copy_(src)

    def idle(self):
        self.log.append("idle")


def kernel_skipping(store, seen=None):
    """The device kernel over the paged tensors, skipping -1 slots as SGLang's Triton MoE does."""
    def kernel(_layer, dispatch_output):
        topk = dispatch_output.topk_output
        if seen is not None:
            seen.append(topk.topk_ids.clone())
        skipped = topk.topk_ids < 0
        return Combine(moe_with_ids(dispatch_output.hidden_states, topk.topk_weights.masked_fill(skipped, 0),
                                    topk.topk_ids.clamp_min(0), store.w13, store.w2))
    return kernel


def routes(router, x):
    gates, ids = torch.topk(torch.softmax(x @ router.T, dim=-1), TOP_K, dim=-1)
    return gates / gates.sum(dim=-1, keepdim=True), ids


@pytest.fixture
def paged(model):  # noqa: F811 (the fixture imported above)
    backend, weights, layout, stores = model
    return SimpleNamespace(backend=backend, weights=weights, layout=layout, stores=stores)


def offload(stores, groups):
    for store in stores:
        for handle in store.offload_tail_pages(groups):
            store.backend.release(handle)
        for dst, _ in store.staging_pairs():
            dst.fill_(float("nan"))  # stale slots: a kernel that reads an offloaded row gives NaN


def test_the_split_masks_offloaded_rows_only():
    ids = torch.tensor([[0, 5, 7], [6, -1, 8], [3, 4, 9]], dtype=torch.int32)
    weights = torch.full((3, 3), 0.5)
    mask_cold_(ids, weights, boundary=5, routed=8)  # rows 5..7 offloaded, 8+ fused shared experts
    assert ids.tolist() == [[0, -1, -1], [-1, -1, 8], [3, 4, 9]]
    assert weights.tolist() == [[0.5, 0.0, 0.0], [0.0, 0.5, 0.5], [0.5, 0.5, 0.5]]


def test_round_trip_adds_the_host_half_to_the_masked_kernel(paged):
    store, (w13, w2, router) = paged.stores[0], paged.weights[LAYERS[1]]
    offload([store], store.layout.bound_groups)
    copies, stats, seen = LoggedCopies(), HostExpertStats(), []
    trip = HostRoundTrip(copies, stats)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(3))
    gates, ids = routes(router, x)
    want = moe_with_ids(x, gates, ids, w13, w2)
    cold = int(((ids >= store.boundary_expert) & (ids < store.routed_experts)).sum())
    live_ids, live_gates = ids.clone(), gates.clone()  # the graph's buffers, masked in place by `send`
    trip.send(store, True, x, live_ids, live_gates)
    out = kernel_skipping(store, seen)(None, Dispatch(x, TopK(live_gates, live_ids)))
    trip.add(out.hidden_states)
    assert cold > 0 and stats.as_dict() == {"pairs": cold, "steps": 1, "pairs_per_step": float(cold)}
    assert int((seen[0] < 0).sum()) == cold and int(seen[0].max()) < store.boundary_expert
    assert torch.allclose(out.hidden_states, want, atol=1e-5, rtol=0)
    assert copies.log == ["refuse_capture", "idle"] + ["device_buffer"] * 4 + ["host_buffer"] * 4 + [
        "to_host", "wait_host", "to_device"]
    assert torch.equal(trip.buffers.host_ids[:12], ids)  # the host saw the ids from before the mask


def test_buffers_are_reused_and_grow_only_after_the_copies_are_idle(paged):
    store, (_w13, _w2, router) = paged.stores[0], paged.weights[LAYERS[1]]
    offload([store], store.layout.bound_groups)
    copies = LoggedCopies()
    trip = HostRoundTrip(copies, HostExpertStats())
    gen = torch.Generator().manual_seed(4)
    pointers = set()
    for tokens in (1, 5, MIN_TOKENS, 3):
        x = torch.randn(tokens, HIDDEN, generator=gen)
        trip.send(store, False, x, *reversed(routes(router, x)))
        trip.add(torch.zeros(tokens, HIDDEN))
        pointers.add(tuple(t.data_ptr() for t in vars(trip.buffers).values() if isinstance(t, torch.Tensor)))
    assert len(pointers) == 1 and trip.buffers.rows == MIN_TOKENS and copies.log.count("idle") == 1
    x = torch.randn(MIN_TOKENS + 1, HIDDEN, generator=gen)
    copies.log.clear()
    trip.send(store, False, x, *reversed(routes(router, x)))
    assert trip.buffers.rows == 2 * MIN_TOKENS and copies.log[:2] == ["refuse_capture", "idle"]


def test_the_host_half_runs_on_its_own_thread_count(paged, monkeypatch):
    """SGLang leaves a GPU server's scheduler at one intra-op thread after loading weights; the host half
    runs with the round trip's `threads` and puts the process's count back."""
    from vamp_sglang.integration.staging import host_experts_cuda

    store, (_w13, _w2, router) = paged.stores[0], paged.weights[LAYERS[1]]
    offload([store], store.layout.bound_groups)
    seen, real = [], host_experts_cuda.cold_output
    monkeypatch.setattr(host_experts_cuda, "cold_output",
                        lambda *args: seen.append(torch.get_num_threads()) or real(*args))
    before = torch.get_num_threads()
    x = torch.randn(8, HIDDEN)
    trip = HostRoundTrip(LoggedCopies(), HostExpertStats(), threads=before + 1)
    trip.send(store, True, x, *reversed(routes(router, x)))
    trip.add(torch.zeros(8, HIDDEN))
    assert seen == [before + 1] and torch.get_num_threads() == before
    assert 1 <= host_experts_cuda.host_threads() <= len(os.sched_getaffinity(0))


def test_only_the_real_rows_cross_are_computed_and_counted(paged):
    """A CUDA graph replayed at 8 rows for 3 tokens: rows [:3] are snapshotted, copied, computed and
    counted; the padding rows' cold slots are masked with the rest and their output stays the kernel's."""
    store, (w13, w2, router) = paged.stores[0], paged.weights[LAYERS[1]]
    offload([store], store.layout.bound_groups)
    stats, seen = HostExpertStats(), []
    trip = HostRoundTrip(LoggedCopies(), stats, real_tokens=lambda: 3)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(6))
    gates, ids = routes(router, x)
    cold = (ids >= store.boundary_expert) & (ids < store.routed_experts)
    assert int(cold[:3].sum()) > 0 and int(cold[3:].sum()) > 0
    live_ids, live_gates = ids.clone(), gates.clone()
    trip.send(store, True, x, live_ids, live_gates)
    out = kernel_skipping(store, seen)(None, Dispatch(x, TopK(live_gates, live_ids)))
    kernel_only = out.hidden_states.clone()
    trip.add(out.hidden_states)
    assert stats.pairs == int(cold[:3].sum()) and int((seen[0] < 0).sum()) == int(cold.sum())
    assert torch.allclose(out.hidden_states[:3], moe_with_ids(x[:3], gates[:3], ids[:3], w13, w2), atol=1e-5,
                          rtol=0)
    assert torch.equal(out.hidden_states[3:], kernel_only[3:]) and bool(out.hidden_states.isfinite().all())
    assert bool((trip.buffers.host_x[3:] == 7).all())  # the padding rows never crossed
    trip.real_tokens = lambda: 100  # a stale count (larger than the rows) is bounded by them
    trip.send(store, False, x, ids.clone(), gates.clone())
    trip.add(torch.zeros(8, HIDDEN))
    assert stats.pairs == int(cold[:3].sum()) + int(cold.sum())


def test_engine_gives_the_real_token_count_only_where_rows_past_it_are_padding(paged):
    for trim, want in ((True, 3), (False, None)):
        engine = StagingEngine(paged.stores, "sync", trim_padding=trim)
        engine.begin_forward(3)
        assert engine.real_tokens() == want
        engine.close()


def fake_topology(root, siblings):
    """A sysfs CPU tree whose CPU c lists `siblings(c)` as its hyperthread siblings."""
    for cpu in range(32):
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_cpus_list").write_text(siblings(cpu) + "\n")


@pytest.mark.parametrize(("allowed", "bound", "want"), [
    (range(32), "0", 2),  # no binding: 16 physical cores over 8 GPUs, not 32 logical CPUs over 8
    ([0, 1, 16, 17], "1", 2),  # SGLang bound this rank to 2 cores and their siblings: all of them
    (range(8), "0", 2),  # 8 cores allowed (a NUMA bind) shared by the ranks: still the rank's share
    ([3, 19], "0", 1),  # one core and its sibling
])
def test_host_threads_count_the_ranks_physical_cores(tmp_path, monkeypatch, allowed, bound, want):
    from vamp_sglang.integration.staging import host_experts_cuda

    fake_topology(tmp_path, lambda cpu: f"{cpu % 16},{cpu % 16 + 16}")  # 16 cores, 2 threads each
    monkeypatch.setattr(host_experts_cuda, "SYS_CPU", tmp_path, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed))
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("SGLANG_SET_CPU_AFFINITY", bound)
    assert host_experts_cuda.host_threads(host_experts_cuda.sglang_binds_ranks()) == want


def test_physical_cores_count_siblings_once_and_unknown_cpus_alone(tmp_path, monkeypatch):
    from vamp_sglang.integration.staging import host_experts_cuda

    fake_topology(tmp_path, lambda cpu: f"{cpu - cpu % 4}-{cpu - cpu % 4 + 3}")  # 4 threads per core
    monkeypatch.setattr(host_experts_cuda, "SYS_CPU", tmp_path)
    assert host_experts_cuda.physical_cores(range(8)) == 2
    assert host_experts_cuda.physical_cores([0, 1, 40, 41]) == 3  # cpu40/41: no topology, a core each


def test_nothing_offloaded_or_nothing_cold_copies_nothing_back(paged):
    store, (_w13, _w2, router) = paged.stores[0], paged.weights[LAYERS[1]]
    copies = LoggedCopies()
    trip = HostRoundTrip(copies, HostExpertStats())
    x = torch.randn(4, HIDDEN)
    gates, ids = routes(router, x)
    trip.send(store, True, x, ids, gates)  # nothing offloaded: the kernel sees every id
    trip.add(torch.zeros(4, HIDDEN))
    assert copies.log == ["refuse_capture"] and int(ids.min()) >= 0
    offload([store], store.layout.bound_groups)
    resident = torch.zeros(4, TOP_K, dtype=ids.dtype)  # every slot on a resident row
    out = torch.ones(4, HIDDEN)
    trip.send(store, True, x, resident, gates)
    trip.add(out)
    assert "to_device" not in copies.log and torch.equal(out, torch.ones(4, HIDDEN)) and trip.stats.pairs == 0


def test_two_breaks_per_layer_replay_the_host_half_after_offloads(paged):
    """A graph captured with nothing offloaded, replayed after two offloads over NaN slots: each eligible
    layer's send / kernel / add runs through SGLang's `eager_on_graph` as under a breakable capture."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import breakable_cuda_graph

    m, capture = paged, StandInCapture()
    stats = HostExpertStats()
    engine = StagingEngine(m.stores, "async", staging="routed", top_k=TOP_K, is_capturing=lambda: capture.capturing)
    engine.chooser.policy = "host"  # every step a host step, as under --vamp-staging host
    experts = moe_staging.ModelExperts(m.backend, m.layout, None, m.stores, engine,
                                       {s.layer_id: SimpleNamespace(layer_id=s.layer_id) for s in m.stores},
                                       {}, None, stats, HostRoundTrip(LoggedCopies(), stats))
    stores = {s.layer_id: s for s in m.stores}
    tokens = 8
    static = {"x": torch.zeros(tokens, HIDDEN)}
    buffers = {lid: (torch.zeros(tokens, TOP_K), torch.zeros(tokens, TOP_K, dtype=torch.int64),
                     torch.zeros(tokens, HIDDEN)) for lid in LAYERS}

    def forward():
        for lid in LAYERS:
            gates, ids, out = buffers[lid]
            w13, w2, router = m.weights[lid]

            def route(router=router, gates=gates, ids=ids):
                g, i = routes(router, static["x"])
                gates.copy_(g)
                ids.copy_(i)

            def kernel(_layer, dispatch_output, out=out, w13=stores[lid].w13 if lid in stores else w13,
                       w2=stores[lid].w2 if lid in stores else w2):
                topk = dispatch_output.topk_output

                def run():
                    skipped = topk.topk_ids < 0
                    out.copy_(moe_with_ids(dispatch_output.hidden_states, topk.topk_weights.masked_fill(skipped, 0),
                                           topk.topk_ids.clamp_min(0), w13, w2))
                capture.launch(run)
                return Combine(out)

            capture.launch(route)
            layer = experts.layers.get(lid, SimpleNamespace(layer_id=lid))
            moe_staging.run_moe_core_staged(experts, kernel, layer, dispatch_output=Dispatch(static["x"],
                                                                                             TopK(gates, ids)))
            capture.launch(lambda out=out: static["x"].add_(out))

    x0 = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(5))
    reference = x0.clone()
    for lid in LAYERS:
        reference = reference + moe_with_ids(reference, *routes(m.weights[lid][2], reference), *m.weights[lid][:2])
    token = breakable_cuda_graph._current_capture_var.set(capture)
    try:
        forward()
        capture._end_current_segment()
    finally:
        breakable_cuda_graph._current_capture_var.reset(token)
    assert len(capture.cuda_graph._break_fns) == 2 * len(m.stores) == moe_staging.staging_breaks(experts)
    for groups in (1, m.layout.bound_groups):
        offload(m.stores, groups - m.stores[0].offloaded_groups)
        pairs = stats.pairs
        static["x"].copy_(x0)
        capture.replay()
        assert torch.allclose(static["x"], reference, atol=1e-4, rtol=0), groups  # NaN without the host half
        assert stats.pairs > pairs
    engine.close()


def test_launcher_serves_host_experts_on_a_gpu_with_the_triton_runner():
    flags = ["--model-path", "/nonexistent/model", "--vamp-staging", "host", "--device", "cuda"]
    for runner in ([], ["--moe-runner-backend", "triton"]):
        launch_server.prepare(flags + runner)
    with pytest.raises(ConfigError, match="--vamp-staging host on a GPU needs SGLang's Triton MoE runner"):
        launch_server.prepare(flags + ["--moe-runner-backend", "flashinfer_cutlass"])


def test_gpu_check_sections_run_their_host_parts():
    """eval/gpu_check.py's `routing_order` and `host_experts` sections on host pages (the capture and the
    CUDA copies need a GPU): the id map survives a reorder and its rollback; the round trip between the
    segments equals the resident layer, and the segments alone read the NaN slots."""
    from eval.gpu_sections import host_experts_graph, routing_order_graph

    backend = host_backend()
    try:
        order = routing_order_graph.check(backend, False)
        host = host_experts_graph.check(backend, False)
    finally:
        backend.close()
    assert order["ok"] and order["swaps"] > 0 and order["rollback_restores_the_identity"]
    assert host["ok"] and [b["batch"] for b in host["graphs"]["batches"]] == [1, 4, 16]
    assert all(b["replay_without_breaks_reads_nan"] for b in host["graphs"]["batches"])
    assert [b["batch"] for b in host["timing"]["batches"]] == [1, 16, 64]
    assert host["timing"]["batches"][-1]["cold_pairs_per_step"] > 0
