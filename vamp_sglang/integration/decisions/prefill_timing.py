"""t_prefill measured where prefill results are ready (issue 10 item 4; the t_prefill of paper Eqs. 2, 4).

On a GPU `Scheduler.run_batch` returns once the forward is *launched* (on the stream
`forward_stream_of(scheduler)` names); the host learns it finished only when `process_batch_result_prefill`
synchronises on the result copy. A host clock around `run_batch` therefore times the launch on a GPU,
and eviction (priced by re-prefill time) would look nearly free. On CUDA this timer records two
timing events on that stream, before and after `run_batch`, and reads them back once the end
event completed: polled without blocking, so a reading appears at the first call after the GPU
finished, at the latest by the result-processing step of that batch. On the host the forward is
synchronous and the host clock around `run_batch` is the measurement, as before.

Use (in the `run_batch` hook):

    with timer.measure(tokens, forward_stream_of(scheduler)):
        result = original(scheduler, batch)
    for tokens, seconds in timer.completed():
        calibrator.observe_prefill(tokens, seconds)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def forward_stream_of(scheduler: Any) -> Any:
    """The stream SGLang 0.5.23's `Scheduler.run_batch` runs the forward on, so the timer's events
    bracket it (issue 19 item 3). Paths under sglang/srt/managers/. Every event loop runs inside
    `StreamContext(schedule_stream)` (scheduler.py:2008). event_loop_normal calls run_batch there
    (scheduler.py:2048), whose non-overlap branches launch the forward on that current stream
    (scheduler.py:4870, 4918). The overlap loop's run_batch enters `forward_stream_ctx` itself
    (scheduler.py:4671, 4903) and the pipeline loop calls run_batch inside it
    (scheduler_pp_mixin.py:1644, 1651); the warm-up picks its stream by the same rule
    (scheduler.py:1161-1165). `scheduler.forward_stream` is the model runner's own stream
    (scheduler.py:1220, tp_worker.py:584), idle without overlap: events recorded there read about 0.
    On the CPU path the timer reads the host clock and ignores the stream."""
    if scheduler.enable_overlap or scheduler.pp_group.world_size > 1:
        return scheduler.forward_stream
    return scheduler.schedule_stream


class PrefillTimer:
    """(prefill tokens, seconds) readings, oldest first, timed on the device clock on CUDA."""

    def __init__(self, device: torch.device | str) -> None:
        self._cuda = torch.device(device).type == "cuda"
        self._in_flight: deque[tuple[int, Any, Any]] = deque()  # CUDA: (tokens, start, end) events
        self._ready: list[tuple[int, float]] = []

    @contextmanager
    def measure(self, tokens: int, stream: Any = None) -> Iterator[None]:
        """Time the enclosed launch of a `tokens`-token prefill; `stream` is the stream the forward runs
        on (CUDA: `forward_stream_of(scheduler)`, default the current stream). A raising body records nothing."""
        if not self._cuda:
            start_s = time.perf_counter()
            yield
            self._ready.append((tokens, time.perf_counter() - start_s))
            return
        stream = stream if stream is not None else torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self._in_flight.append((tokens, start, end))

    def completed(self) -> list[tuple[int, float]]:
        """Readings whose forward has finished since the last call; never blocks."""
        while self._in_flight and self._in_flight[0][2].query():
            tokens, start, end = self._in_flight.popleft()
            self._ready.append((tokens, start.elapsed_time(end) / 1e3))
        ready, self._ready = self._ready, []
        return ready

    @property
    def in_flight(self) -> int:
        """Prefills launched whose device time is not read yet."""
        return len(self._in_flight)
