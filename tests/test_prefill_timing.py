"""t_prefill where results are ready (issue 10 item 4): the host clock on CPU, device events on CUDA."""

import time

import pytest
import torch

from vamp_sglang.integration.prefill_timing import PrefillTimer


def test_cpu_readings_are_the_host_clock_around_run_batch():
    timer = PrefillTimer("cpu")
    with timer.measure(128):
        time.sleep(0.02)
    with pytest.raises(RuntimeError), timer.measure(64):
        raise RuntimeError("the forward failed")  # nothing recorded for it
    (reading,) = timer.completed()
    assert reading[0] == 128 and 0.02 <= reading[1] < 0.5
    assert timer.completed() == [] and timer.in_flight == 0


@pytest.mark.gpu
def test_cuda_readings_time_the_device_not_the_launch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none here)")
    timer = PrefillTimer("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    stream = torch.cuda.Stream()
    a @ a  # cuBLAS initialises on the first matmul, on the host
    torch.cuda.synchronize()
    launch = time.perf_counter()
    with timer.measure(4096, stream), torch.cuda.stream(stream):
        for _ in range(20):
            a = a @ a / 64  # enqueued: returns long before the GPU finishes
    launch = time.perf_counter() - launch
    torch.cuda.synchronize()
    (reading,) = timer.completed()
    assert reading[0] == 4096 and reading[1] > launch  # the launch alone would look nearly free
