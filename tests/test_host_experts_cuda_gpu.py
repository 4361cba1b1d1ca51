"""`--vamp-staging host` on CUDA (issue 49) with SGLang's Triton fused MoE as the device kernel: the cold
slots masked as -1 are skipped by the kernel (the offloaded rows hold NaN, so a read shows), the host
half crosses through pinned buffers on the side stream, and the sum matches the layer with every expert
resident, for decode and prefill batch sizes; also with `--enable-fused-moe-sum-all-reduce`, where the
kernel sums the top-k slots into the [tokens, hidden] output with atomic adds and a block of -1 ids must
write nothing there (fused_moe_triton_kernels.py:462-477). Not yet run on a GPU."""

import pytest
import torch
from test_staging_routed_gpu import EXPERTS, HIDDEN, TOP_K, cuda_model  # noqa: F401 (cuda_model: fixture)

from vamp_sglang.integration.staging.host_experts import HostExpertStats
from vamp_sglang.integration.staging.host_experts_cuda import CudaCopies, HostRoundTrip

pytestmark = pytest.mark.gpu
_KERNELS = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"


@pytest.mark.parametrize("fused_sum", [False, True])
def test_triton_kernel_plus_host_half_is_the_resident_layer(cuda_model, fused_sum):  # noqa: F811 (fixture)
    import importlib

    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.test.test_utils import published_topology

    kernels = importlib.import_module(_KERNELS)
    weights, stores = cuda_model  # every eligible layer's offloadable groups offloaded
    store = stores[0]
    w13, w2, router = weights[store.layer_id]
    for dst, _ in store.staging_pairs():
        dst.fill_(float("nan"))
    config = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=EXPERTS, top_k=TOP_K, inplace=False)
    stats = HostExpertStats()
    trip = HostRoundTrip(CudaCopies(torch.device("cuda", 0), timed=True), stats)
    with published_topology(tp_size=1, enable_fused_moe_sum_all_reduce=fused_sum):  # TOP_K 4 > 2: fused
        for tokens in (1, 16, 64, 300):
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            logits = x @ router.T
            gates, ids = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K)
            ids = ids.to(torch.int32)
            want = kernels.fused_experts(x, w13, w2, StandardTopKOutput(gates, ids, logits), config)
            live_gates, live_ids = gates.clone(), ids.clone()
            trip.send(store, True, x, live_ids, live_gates)
            out = kernels.fused_experts(x, store.w13, store.w2, StandardTopKOutput(live_gates, live_ids, logits),
                                        config)
            trip.add(out)
            torch.cuda.synchronize()
            assert int((live_ids < 0).sum()) > 0 and bool(out.isfinite().all()), tokens  # no offloaded row read
            assert float((out - want).abs().max()) <= 2e-2 * float(want.abs().max()), tokens  # bf16 sums
    d2h_ms, h2d_ms = trip.copies.copy_ms()
    assert stats.pairs > 0 and d2h_ms > 0 and h2d_ms > 0 and trip.buffers.rows == 512
