"""The staging engine: offloaded experts copied one MoE layer ahead, overlapped with compute (paper IV-D,
V-B, Figure 5).

Two staging slots alternate by eligible-layer parity (staging_slots.py). As soon as MoE layer N may
start (`before_moe(N)` has waited for N's own copy), the offloaded region of the next eligible layer is
copied from its host copy into the other slot, so the copy overlaps layer N's MoE computation and the
dense and router work before the next MoE layer. The other slot's last reader, eligible layer N-1, has
finished by then: on the host the forward is synchronous; on CUDA the copy stream waits for the slot's
event, recorded after that layer's MoE was enqueued (`after_moe`) or, when `after_moe` did not run (a
graph replay), at the launch itself on the compute stream, which orders it after every kernel enqueued
so far. Copies run on a copy stream (CUDA) or a single worker thread (host, with one intra-op thread so
it overlaps the compute thread instead of fighting it for cores; research/host-vmm.md section 4). The
whole contiguous offloaded region is staged whatever the router selects (IV-D). The first eligible layer
is prefetched at forward start (`begin_forward`).

The slots are aliased into the expert tensors (staging_slots.py), so these hooks may run eagerly between
the segments of a CUDA graph that holds the MoE kernels. While a stream is capturing the hooks do
nothing: an event recorded in a capture is a graph node, and an eager wait on it is invalid (issue 10
item 1). The two slot events are therefore recorded once at construction, outside any capture, as
SGLang's DWDP weight manager does. Each copy is timed where it runs (staging_stats.py, issue 10 item 5).

Routed-only staging (issue 12): a step may instead copy, at each eligible layer once its router ran, only
the offloaded experts some token selected (memory/routed.py), in the compute stream or thread, with no
prefetch. `begin_forward(tokens)` picks the step's mode (staging_choice.py: from the measured bandwidths,
the measured overlap window and the expected distinct experts for that many tokens); `before_moe(layer_id,
topk_ids)` then stages that way. Both modes write the same aliased rows, so they mix freely across steps.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from vamp_sglang.memory.experts import ExpertStore
from vamp_sglang.memory.routed import copy_routed_host, routed_offloaded_runs
from vamp_sglang.memory.staging_choice import ROUTED, WHOLE, StagingChooser
from vamp_sglang.memory.staging_stats import StagedCopy, StagingLedger, StagingStats

STAGING_MODES = ("async", "sync")
logger = logging.getLogger(__name__)


class StagingEngine:
    """Fills each eligible layer's offloaded experts one MoE layer ahead (paper V-B, Figure 5)."""

    def __init__(self, stores: Sequence[ExpertStore], mode: str = "async",
                 is_capturing: Callable[[], bool] | None = None, split_w2_wait: bool = False,
                 staging: str = WHOLE, top_k: int | None = None,
                 routed_copier: Callable[[ExpertStore, torch.Tensor], torch.Tensor] | None = None,
                 ep_size: int = 1, host_capable: bool = False, trim_padding: bool = False) -> None:
        """`is_capturing()` says whether the current stream is capturing a CUDA graph (default: torch's
        check on CUDA, never on the host). `split_w2_wait`: `before_moe` waits only for w13 and the
        caller calls `before_down_proj` before the down projection reads w2 (paper V-B). `staging`: auto,
        whole or routed (issue 12); `top_k` is the router's, `routed_copier(store, topk_ids)` enqueues a
        routed copy on the current CUDA stream and returns its device row count (the host copies itself).
        `ep_size` is the MoE's expert-parallel size (SGLang's `moe_ep_size`): the stores hold this rank's
        routed/ep experts, but the router picks its top-k among all of them, so a local expert is selected
        by T tokens with probability 1-(1-k/(E_local * ep))^T; priced with E_local the routed rows came out
        about ep times too many until the measured ratio corrected them (issue 45). `host_capable`: the caller
        can compute cold experts on the host, so the chooser may pick `host` steps (issue 49).
        `trim_padding`: the top-k rows past the step's token count are padding (a CUDA graph replayed at a
        larger batch; only where the MoE sees this rank's own tokens), so routed steps neither copy nor
        count what those rows select."""
        if mode not in STAGING_MODES:
            raise ValueError(f"staging mode must be one of {', '.join(STAGING_MODES)} (got {mode!r})")
        if ep_size < 1:
            raise ValueError(f"ep_size must be at least 1 (got {ep_size})")
        self.mode = mode
        self.split_w2_wait = split_w2_wait
        self._stores = list(stores)
        self._layer_ids = [s.layer_id for s in self._stores]
        if self._layer_ids != sorted(self._layer_ids):
            raise ValueError(f"stores must be in forward order (got layer ids {self._layer_ids})")
        self._index = {layer_id: i for i, layer_id in enumerate(self._layer_ids)}
        device = self._stores[0].w13.device if self._stores else torch.device("cpu")
        self._cuda = device.type == "cuda"
        if is_capturing is None:
            is_capturing = torch.cuda.is_current_stream_capturing if self._cuda else _never
        self._is_capturing = is_capturing
        if self._cuda and staging != WHOLE and routed_copier is None:
            raise ValueError(f"staging {staging!r} on CUDA needs a routed_copier")
        self._routed_copier = routed_copier
        global_routed = self._stores[0].routed_experts * ep_size if self._stores else 0
        self.chooser = StagingChooser(staging, top_k, global_routed, measure_steps=not self._cuda,
                                      host_capable=host_capable)
        self.trim_padding = trim_padding
        self._step_mode, self._step_tokens, self._step_start = WHOLE, None, 0.0
        self._pending: dict[int, StagedCopy] = {}  # eligible index -> copy in flight
        self._w2_pending: dict[int, StagedCopy] = {}  # split waits: w13 waited, w2 not yet
        self.missed_w2_waits = 0  # layers whose down GEMM ran without before_down_proj (split then off)
        self._timing = StagingLedger(self.chooser, self._stores[0] if self._stores else None)  # counts, times
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None
        self._slot_free: list[Any] = []
        self._reader_open = [False, False]  # the slot's reader waited but its after_moe did not run
        if mode == "async" and self._cuda:
            self._stream = torch.cuda.Stream(device)
            self._slot_free = [torch.cuda.Event(), torch.cuda.Event()]
            for event in self._slot_free:  # once, outside any capture: every later wait is on an eager record
                event.record(torch.cuda.current_stream(device))
        elif mode == "async":
            self._executor = ThreadPoolExecutor(1, "vamp-staging", initializer=torch.set_num_threads,
                                                initargs=(1,))
        self._step = 0

    def begin_forward(self, tokens: int | None = None) -> None:
        """Pick this step's staging mode for `tokens` tokens (issue 12); whole: prefetch the first
        eligible layer at forward start (the first MoE layer is resident)."""
        if self._is_capturing():
            return
        self._step += 1
        self._timing.harvest(self._step)
        self._step_tokens, self._step_start = tokens, time.perf_counter()
        store = self._stores[0] if self._stores else None
        self._step_mode = WHOLE if store is None or not store.offloaded_groups else self.chooser.choose(
            self._step, tokens, store.staged_bytes(), store.routed_experts - store.boundary_expert,
            _row_bytes(store))
        self._timing.by_mode[self._step_mode]["steps"] += 1
        if self._stores and self.mode == "async" and self._step_mode == WHOLE:
            self._launch(0)

    def before_moe(self, layer_id: int, topk_ids: torch.Tensor | None = None) -> None:
        """Right before `layer_id`'s MoE kernel: block until its offloaded experts are staged, then start
        staging the next eligible layer into the other slot (paper V-B). In a routed step, copy only the
        offloaded experts `topk_ids` (the router's, [tokens, k]) selected, and prefetch nothing."""
        if self._is_capturing():
            return
        i = self._index.get(layer_id)
        routed = self._step_mode == ROUTED and topk_ids is not None
        if i is not None and self._stores[i].offloaded_groups and routed and i not in self._pending:
            self._stage_routed(i, topk_ids)
            self._reader_open[i % 2] = True  # a later prefetch into this slot must follow this layer's MoE
        elif i is not None and self._stores[i].offloaded_groups:
            if i not in self._pending:
                self._timing.unprefetched += self.mode == "async"
                self._launch(i)
            copy = self._pending.pop(i)
            copy.split = self.split_w2_wait
            self._wait(copy, copy.w13_done if copy.split else copy.w2_done)
            if copy.split:
                self._w2_pending[i] = copy
            self._reader_open[i % 2] = True
        nxt = bisect.bisect_right(self._layer_ids, layer_id)
        if self.mode == "async" and self._step_mode == WHOLE and nxt < len(self._stores):
            self._launch(nxt)

    @property
    def step_mode(self) -> str:
        return self._step_mode

    def real_tokens(self) -> int | None:
        """The step's token count where rows past it are padding (`trim_padding`), else None (every row is
        a token, or the count is unknown): what routed staging trims to, and the host round trip too."""
        return self._step_tokens if self.trim_padding else None

    def host_layer(self, pairs: int, seconds: float) -> None:
        """A host step's layer computed `pairs` cold pairs on the host in `seconds` (issue 49)."""
        self.chooser.observe_host(self._step, self._step_tokens, pairs, seconds)

    def before_down_proj(self, layer_id: int) -> None:
        """With `split_w2_wait`: right before the down projection, wait for the layer's w2 copy."""
        copy = None if self._is_capturing() else self._w2_pending.pop(self._index.get(layer_id, -1), None)
        if copy is not None:
            self._wait(copy, copy.w2_done, timed=False)

    def after_moe(self, layer_id: int) -> None:
        """Right after `layer_id`'s MoE kernel was issued: on CUDA, mark its slot free for the copy two
        eligible layers later (host: the kernel already finished)."""
        i = self._index.get(layer_id)
        if i is None or self._is_capturing():
            return
        if i in self._w2_pending:  # split waits, but nothing waited for w2 before the down GEMM read it
            self.missed_w2_waits += 1
            self.split_w2_wait = False  # wait for both at before_moe from the next layer on
            logger.warning("vamp: layer %d's down GEMM ran without waiting for its staged w2; split "
                           "w13/w2 waits are off from now on", layer_id)
            self.before_down_proj(layer_id)  # and order w2 before the slot is refilled
        if self._stream is not None:
            self._slot_free[i % 2].record(torch.cuda.current_stream(self._stream.device))
        self._reader_open[i % 2] = False
        if i == len(self._stores) - 1 and self._stores[i].offloaded_groups:  # the part staging touches
            self.chooser.observe_step(self._step, self._step_tokens, self._step_mode,
                                      time.perf_counter() - self._step_start)

    def drain(self) -> None:
        """Finish and forget in-flight copies (before a remap changes the boundary)."""
        for copy in [*self._pending.values(), *self._w2_pending.values()]:
            _finish(copy.w2_done)
        self._pending.clear()
        self._w2_pending.clear()

    def stats(self) -> StagingStats:
        """Everything since start-up (the decisions difference its cumulative wait)."""
        return self._timing.stats(self._step)

    def served_stats(self) -> StagingStats:
        """What `/vamp/stats` reports: the figures less those `exclude_from_served` took out."""
        return self._timing.served(self._step)

    def exclude_from_served(self, since: StagingStats | None = None) -> None:
        """What was counted after `since` (a `stats()` snapshot; None: from start-up) is not served traffic."""
        self._timing.exclude(self._step, since)

    def close(self) -> None:
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _launch(self, i: int) -> None:
        store = self._stores[i]
        if i in self._pending or store.offloaded_groups == 0:
            return
        pairs = store.staging_pairs()  # [(w13 rows, host), (w2 rows, host)]
        nbytes = store.staged_bytes()
        self._timing.issued(WHOLE, nbytes)
        if self._stream is not None:
            copy = self._launch_cuda(i % 2, pairs)
        else:
            copy = StagedCopy(self._step, Future(), Future())
            if self._executor is not None:
                self._executor.submit(self._copy_host, copy, pairs)
            else:
                self._copy_host(copy, pairs)
        copy.nbytes, copy.tokens = nbytes, self._step_tokens
        self._pending[i] = copy

    def _stage_routed(self, i: int, topk_ids: torch.Tensor) -> None:
        """Copy the routed offloaded experts of eligible layer `i` now, in the compute stream or thread:
        the MoE kernel that follows reads them (issue 12). The copy is all wait (not overlapped)."""
        store = self._stores[i]
        if self.trim_padding and self._step_tokens is not None:
            topk_ids = topk_ids[:self._step_tokens]
        self._timing.issued(ROUTED)
        copy = StagedCopy(self._step, None, None, mode=ROUTED, tokens=self._step_tokens,
                          row_bytes=_row_bytes(store))
        if self._stream is not None:  # CUDA: device-side copy list and gather, timed by compute-stream events
            compute = torch.cuda.current_stream(self._stream.device)
            copy.start, copy.w2_done = _timing_event(), _timing_event()
            copy.start.record(compute)
            count = self._routed_copier(store, topk_ids)
            copy.rows = torch.empty(1, dtype=torch.int32, pin_memory=True)
            copy.rows.copy_(count, non_blocking=True)  # read at harvest, once the event completed
            copy.w2_done.record(compute)
            copy.w13_done, copy.reached = copy.w2_done, copy.start
        else:
            start = time.perf_counter()
            runs = routed_offloaded_runs(topk_ids, store.boundary_expert, store.routed_experts)
            copy_routed_host(store, runs)
            copy.copy_s = copy.wait_s = time.perf_counter() - start
            copy.rows = sum(end - first for first, end in runs)
            copy.w13_done = copy.w2_done = Future()
            copy.w2_done.set_result(None)
        self._timing.waited(copy)

    def _launch_cuda(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> StagedCopy:
        compute = torch.cuda.current_stream(self._stream.device)
        if self._reader_open[slot]:  # its after_moe did not run (graph replay): everything enqueued so far
            self._slot_free[slot].record(compute)  # on the compute stream includes that reader's MoE kernel
            self._reader_open[slot] = False
        copy = StagedCopy(self._step, _timing_event(), _timing_event(), start=_timing_event())
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._slot_free[slot])
            copy.start.record(self._stream)
            for (dst, src), done in zip(pairs, (copy.w13_done, copy.w2_done), strict=True):
                dst.copy_(src, non_blocking=True)
                done.record(self._stream)
        return copy

    def _copy_host(self, copy: StagedCopy, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Worker side: w13, then w2, each completing its own future; the worker's clock times both."""
        start = time.perf_counter()
        futures = (copy.w13_done, copy.w2_done)
        try:
            for (dst, src), done in zip(pairs, futures, strict=True):
                dst.copy_(src)
                copy.copy_s = time.perf_counter() - start
                done.set_result(None)
        except BaseException as exc:  # every waiter sees the failure instead of blocking forever
            for done in futures:
                if not done.done():
                    done.set_exception(exc)
            raise

    def _wait(self, copy: StagedCopy, done: Any, timed: bool = True) -> None:
        """Make the compute side wait for `done`; the first wait of a copy is the one that is timed."""
        if isinstance(done, Future):
            stalled = not done.done()
            start = time.perf_counter()
            done.result()
            if timed:
                copy.wait_s, copy.stalled = (time.perf_counter() - start) * stalled, stalled
                self._timing.waited(copy)
            return
        compute = torch.cuda.current_stream(self._stream.device)
        if timed:
            copy.reached = _timing_event()
            copy.reached.record(compute)
            self._timing.waited(copy)
        compute.wait_event(done)


def _row_bytes(store: ExpertStore) -> int:
    """w13 + w2 bytes of one expert (the layout's shard sizes)."""
    return store.layout.w13_shard_bytes + store.layout.w2_shard_bytes


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _finish(done: Any) -> None:
    if isinstance(done, Future):
        done.result()
    else:
        done.synchronize()


def _never() -> bool:
    return False
