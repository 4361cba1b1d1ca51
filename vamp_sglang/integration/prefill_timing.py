"""t_prefill measured where prefill results are ready (issue 10 item 4; the t_prefill of paper Eqs. 2, 4).

Under SGLang's overlap scheduler `Scheduler.run_batch` returns once the forward is *launched* on
`scheduler.forward_stream`; the host learns it finished only when `process_batch_result_prefill`
synchronises on the result copy. A host clock around `run_batch` therefore times the launch on a GPU,
and eviction (priced by re-prefill time) would look nearly free. On CUDA this timer records two
timing events on the forward stream, before and after `run_batch`, and reads them back once the end
event completed: polled without blocking, so a reading appears at the first call after the GPU
finished, at the latest by the result-processing step of that batch. On the host the forward is
synchronous and the host clock around `run_batch` is the measurement, as before.

Use (in the `run_batch` hook):

    with timer.measure(tokens, scheduler.forward_stream):
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


class PrefillTimer:
    """(prefill tokens, seconds) readings, oldest first, timed on the device clock on CUDA."""

    def __init__(self, device: torch.device | str) -> None:
        self._cuda = torch.device(device).type == "cuda"
        self._in_flight: deque[tuple[int, Any, Any]] = deque()  # CUDA: (tokens, start, end) events
        self._ready: list[tuple[int, float]] = []

    @contextmanager
    def measure(self, tokens: int, stream: Any = None) -> Iterator[None]:
        """Time the enclosed launch of a `tokens`-token prefill; `stream` is the stream the forward runs
        on (CUDA: `scheduler.forward_stream`, default the current stream). A raising body records nothing."""
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
