"""t_prefill timed on the stream the forward runs on (issue 19 item 3), on a real GPU.

SGLang's scheduler launches the forward on `schedule_stream` without the overlap scheduler and on the
model runner's `forward_stream` with it (see `forward_stream_of`); timing events recorded on the other,
idle stream read about 0, which made eviction look free. For each loop this section launches a
prefill-sized burst of matmuls on the stream that loop uses (both non-default streams, as in SGLang),
times it with the project's PrefillTimer on `forward_stream_of(scheduler)` and on the other stream,
and compares both with the host clock around launch plus synchronize.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from vamp_sglang.integration.decisions.prefill_timing import PrefillTimer, forward_stream_of

MATRIX = 4096  # one 4096^2 fp32 matmul: ~137 GFLOP, milliseconds of work per burst on any GPU
MATMULS = 20
TOKENS = 4096  # the prefill size the readings are labelled with
WRONG_STREAM_FRACTION = 0.1  # the idle stream's reading must stay under this share of the real time
CHOSEN_STREAM_FRACTION = 0.5  # the chosen stream's reading must reach this share of it


def _burst(x: torch.Tensor) -> torch.Tensor:
    """MATMULS matmuls by x, scaled so the values stay finite (x / sqrt(n) has spectral norm about 2)."""
    y = x
    for _ in range(MATMULS):
        y = x @ y / MATRIX**0.5
    return y


def _time_loop(x: torch.Tensor, enable_overlap: bool) -> dict:
    """One loop's forward on its own stream, timed on the chosen stream and on the other one."""
    runner_stream, schedule_stream = torch.cuda.Stream(), torch.cuda.Stream()
    scheduler = SimpleNamespace(enable_overlap=enable_overlap, pp_group=SimpleNamespace(world_size=1),
                                forward_stream=runner_stream, schedule_stream=schedule_stream)
    launch_stream, idle_stream = (runner_stream, schedule_stream) if enable_overlap \
        else (schedule_stream, runner_stream)
    chosen, wrong = PrefillTimer("cuda"), PrefillTimer("cuda")
    torch.cuda.synchronize()
    start_s = time.perf_counter()
    with chosen.measure(TOKENS, forward_stream_of(scheduler)), wrong.measure(TOKENS, idle_stream), \
            torch.cuda.stream(launch_stream):
        _burst(x)
    launch_s = time.perf_counter() - start_s
    torch.cuda.synchronize()
    host_s = time.perf_counter() - start_s
    ((_, chosen_s),), ((_, wrong_s),) = chosen.completed(), wrong.completed()
    return {"chosen_stream_is_the_launch_stream": forward_stream_of(scheduler) is launch_stream,
            "chosen_ms": round(chosen_s * 1e3, 3), "other_stream_ms": round(wrong_s * 1e3, 3),
            "host_ms": round(host_s * 1e3, 3), "launch_ms": round(launch_s * 1e3, 3),
            "chosen_reads_the_real_time": CHOSEN_STREAM_FRACTION * host_s <= chosen_s <= host_s,
            "other_stream_reads_about_0": wrong_s < WRONG_STREAM_FRACTION * host_s}


def check(backend, gpu: bool) -> dict:
    """PrefillTimer on forward_stream_of(scheduler) reads the forward's time, the other stream about 0, in both loops."""
    del backend, gpu  # plain CUDA streams and tensors; no pages involved
    x = torch.randn(MATRIX, MATRIX, device="cuda")
    _burst(x)  # cuBLAS initialises on the first matmul, on the host
    result = {"normal_loop": _time_loop(x, enable_overlap=False),
              "overlap_loop": _time_loop(x, enable_overlap=True)}
    result["ok"] = all(v for loop in result.values() for k, v in loop.items() if not k.endswith("_ms"))
    return result
