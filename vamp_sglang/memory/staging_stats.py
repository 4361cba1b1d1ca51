"""What the staging engine measures: its copies' times, counts and bytes, summed into StagingStats (paper
V-B; issue 10 item 5, issue 12).

Copy and wait times are measured where the work happens (issue 10 item 5): on CUDA with timing events
read back once they completed (never by querying the copy when the CPU enqueues the wait), on the host
with the worker's and the waiting thread's clocks. Each figure is also kept per staging mode, and every
read-back copy is reported to the staging choice (staging_choice.py), which picks later steps' modes
from these measurements.

What `/vamp/stats` reports is served traffic (issue 49): what the warm-up request and health probes
staged is excluded (`exclude`, integration/metrics/served_traffic.py), while the measurements the decisions
difference (the cumulative wait) keep counting from start-up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from vamp_sglang.memory.experts import ExpertStore
from vamp_sglang.memory.staging_choice import HOST, ROUTED, WHOLE, StagingChooser


@dataclass(frozen=True)
class StagingStats:
    """Cumulative staging figures, and the last completed step's (a step = one forward)."""

    wait_s: float  # time the compute side stood waiting for a copy (CUDA: device clock, host: thread clock)
    copy_s: float  # time the copies took (CUDA: copy-stream events, host: the worker's clock)
    bytes_staged: int
    copies: int
    stalls: int  # copies not finished when their layer's MoE was reached (measured, not guessed)
    unprefetched: int  # copies issued at before_moe because nothing prefetched them
    steps: int  # forwards begun (begin_forward calls outside capture)
    timed_copies: int  # copies whose times were read back so far (CUDA reads them once they completed)
    step_copy_s: float  # copy_s of the last step whose copies were all read back
    step_wait_s: float  # wait_s of that step
    by_mode: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # whole / routed / host: steps,
    # bytes, copy_s, wait_s (issue 12)

    def since(self, base: StagingStats) -> StagingStats:
        """The cumulative figures counted after `base` was taken (the last step's stay as they are)."""
        totals = {f.name: getattr(self, f.name) - getattr(base, f.name) for f in fields(self)
                  if f.name not in ("step_copy_s", "step_wait_s", "by_mode")}
        by_mode = {m: {k: v - base.by_mode.get(m, {}).get(k, 0) for k, v in row.items()}
                   for m, row in self.by_mode.items()}
        return replace(self, **totals, by_mode=by_mode)


@dataclass(eq=False)
class StagedCopy:
    """One layer's staging copy: w13 first, then w2, each with its own completion (paper V-B: the gate-up
    GEMM needs only w13). Host: futures; CUDA: events on the copy stream."""

    step: int
    w13_done: Any
    w2_done: Any
    start: Any = None  # CUDA: timing event before the first copy
    reached: Any = None  # CUDA: timing event on the compute stream where the layer waited
    copy_s: float = 0.0  # host: measured by the worker
    wait_s: float = 0.0  # host: measured by the waiting thread
    stalled: bool = False
    split: bool = False  # its layer waited for w13 only at before_moe (w2 before the down GEMM)
    mode: str = WHOLE  # whole-region prefetch or routed-only copy (issue 12)
    tokens: int | None = None  # the step's token count, for the staging choice
    nbytes: int = 0  # whole: bytes staged; routed: filled in once the row count is read
    rows: Any = None  # routed: distinct offloaded rows copied (host int; CUDA: pinned int32[1] read later)
    row_bytes: int = 0  # routed: w13 + w2 bytes of one expert


class StagingLedger:
    """The engine's counters, and the waited copies whose times are not read yet (its length)."""

    def __init__(self, chooser: StagingChooser, store: ExpertStore | None) -> None:
        """`store`: the first eligible layer's, whose boundary gives the offloaded rows (None: no stores)."""
        self.chooser = chooser
        self._store = store
        self._waiting: deque[StagedCopy] = deque()
        self.bytes, self.copies, self.unprefetched = 0, 0, 0
        self.wait_s, self.copy_s, self.stalls, self.timed = 0.0, 0.0, 0, 0
        self.by_mode = {m: {"steps": 0, "bytes": 0, "copy_s": 0.0, "wait_s": 0.0} for m in (WHOLE, ROUTED, HOST)}
        self._excluded: StagingStats | None = None  # the figures counted outside served traffic
        self._step_open = (-1, 0.0, 0.0)  # (step, copy_s, wait_s) being summed while its copies are read
        self._step_done = (0.0, 0.0)

    def __len__(self) -> int:
        return len(self._waiting)

    def issued(self, mode: str, nbytes: int = 0) -> None:
        """One copy issued; whole copies count their bytes now, as bytes_staged (routed: once read)."""
        self.copies += 1
        self.bytes += nbytes
        self.by_mode[mode]["bytes"] += nbytes

    def waited(self, copy: StagedCopy) -> None:
        """`copy` was waited for (or ran inline): its times are read once it completed."""
        self._waiting.append(copy)

    def stats(self, steps: int) -> StagingStats:
        self.harvest(steps)
        return StagingStats(self.wait_s, self.copy_s, self.bytes, self.copies, self.stalls, self.unprefetched,
                            steps, self.timed, *self._step_done,
                            by_mode={m: dict(v) for m, v in self.by_mode.items()})

    def exclude(self, steps: int, since: StagingStats | None) -> None:
        """What was counted after `since` (a `stats` snapshot; None: everything so far) is not served:
        the excluded figures become now - (served at `since`)."""
        now = self.stats(steps)
        served_then = None if since is None else since if self._excluded is None else since.since(self._excluded)
        self._excluded = now if served_then is None else now.since(served_then)

    def served(self, steps: int) -> StagingStats:
        stats = self.stats(steps)
        return stats if self._excluded is None else stats.since(self._excluded)

    def harvest(self, step_now: int) -> None:
        """Read back the times of waited copies that completed, in order, without blocking."""
        while self._waiting and _completed(self._waiting[0]):
            copy = self._waiting.popleft()
            if copy.reached is not None:  # CUDA: device clocks
                copy.copy_s = copy.start.elapsed_time(copy.w2_done) / 1e3
                copy.wait_s = max(0.0, copy.reached.elapsed_time(copy.w13_done if copy.split
                                                                 else copy.w2_done)) / 1e3
                copy.stalled = copy.wait_s > 0
            self.copy_s += copy.copy_s
            self.wait_s += copy.wait_s
            self._account(copy)
            self.stalls += copy.stalled
            self.timed += 1
            step, step_copy, step_wait = self._step_open
            if copy.step != step:
                if step >= 0:
                    self._step_done = (step_copy, step_wait)
                step, step_copy, step_wait = copy.step, 0.0, 0.0
            self._step_open = (step, step_copy + copy.copy_s, step_wait + copy.wait_s)
        step, step_copy, step_wait = self._step_open
        if step >= 0 and not self._waiting and step < step_now:  # that step's copies are all read
            self._step_done = (step_copy, step_wait)

    def _account(self, copy: StagedCopy) -> None:
        """Per-mode totals, and the staging choice's measurements, of one copy whose times were read."""
        offloaded_rows = self._store.routed_experts - self._store.boundary_expert
        if copy.mode == ROUTED:
            rows = int(copy.rows.item()) if isinstance(copy.rows, torch.Tensor) else copy.rows
            copy.nbytes = rows * copy.row_bytes
            self.bytes += copy.nbytes
            self.by_mode[ROUTED]["bytes"] += copy.nbytes
            self.chooser.observe_routed(copy.tokens, copy.nbytes, copy.copy_s,
                                        None if isinstance(copy.rows, torch.Tensor) else rows, offloaded_rows)
        else:
            self.chooser.observe_whole(copy.step, copy.tokens, copy.nbytes, copy.copy_s, copy.wait_s)
        totals = self.by_mode[copy.mode]
        totals["copy_s"] += copy.copy_s
        totals["wait_s"] += copy.wait_s


def _completed(copy: StagedCopy) -> bool:
    if copy.reached is None:
        return copy.w2_done.done()
    return copy.w2_done.query() and copy.reached.query()
