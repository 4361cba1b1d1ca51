"""t_prefill where results are ready (issue 10 item 4): the host clock on CPU, device events on CUDA."""

import time
from types import SimpleNamespace

import pytest
import torch

from vamp_sglang.integration.decisions.prefill_timing import PrefillTimer, forward_stream_of


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


def scheduler(enable_overlap: bool, pp_size: int = 1) -> SimpleNamespace:
    """The fields of SGLang 0.5.23's Scheduler that pick the forward's stream (managers/scheduler.py):
    forward_stream is the model runner's stream (get_worker_info, line 1220), schedule_stream the
    stream the event loop runs in (lines 1159, 2008), pp_group the pipeline group (line 1251)."""
    return SimpleNamespace(enable_overlap=enable_overlap, pp_group=SimpleNamespace(world_size=pp_size),
                           forward_stream=object(), schedule_stream=object())


def test_without_overlap_the_forward_is_timed_on_the_schedule_stream_not_on_forward_stream():
    normal = scheduler(enable_overlap=False)
    assert forward_stream_of(normal) is normal.schedule_stream
    assert getattr(normal, "forward_stream", None) is not normal.schedule_stream  # the stream it used to time


def test_the_overlap_and_pipeline_loops_run_the_forward_on_forward_stream():
    for sched in (scheduler(enable_overlap=True), scheduler(enable_overlap=False, pp_size=2)):
        assert forward_stream_of(sched) is sched.forward_stream
