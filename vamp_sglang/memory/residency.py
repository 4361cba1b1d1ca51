"""Residency by routing: which experts an eligible layer offloads follows how often the router picks them.

Paper IV-C offloads a layer's highest-index expert groups, whatever the router prefers. Real routing is
mildly skewed (../shared/research/routing-stats.md: the hottest quarter of a layer's experts takes about a
third of the selections), so a region holding the coldest experts is read less often: routed staging
copies fewer rows and host-computed experts see fewer tokens (the decode-cost bench's `routed+order`:
0.73x routed's bytes on DeepSeek-V2-Lite at batch 1). Page boundaries stay where they are; what moves
is the experts. Physical row p of the expert tensors holds logical expert `logical_at[p]`, and the
router's top-k ids are mapped logical -> physical right before the MoE kernel, as SGLang maps logical
to physical experts for EPLB (`topk_ids_logical_to_physical`, layers/moe/topk.py), so outputs do not
change.

- `RoutingCounts`: decayed selection counts per eligible layer and logical expert, accumulated on the
  device from the top-k ids VAMP already sees (fixed shapes: graph safe), summed when a transaction reads
  them over the ranks that run it together (one round group: controller/groups.py), so they plan alike.
  Only the step's real token rows count: a CUDA graph replayed at a larger batch (decode at batch 9
  replays the batch-16 graph) routes its padding rows like tokens under plain TP, where SGLang keeps no
  device count of real tokens (its `num_token_non_padded` exists only where
  `enable_num_token_non_padded()`, forward_batch_info.py:2271-2285, decode_cuda_graph_runner.py:1225-1229),
  so the counts keep their own device scalar, written before each forward (as SGLang fills its HiSparse
  `num_real_reqs` before a replay, model_runner.py:1997-2003) and read inside the graph.
- `ExpertOrder`: the logical -> physical map per layer, a device tensor the MoE path reads in place.
- `reorder_rows`: inside an offload or restore transaction, swap expert rows (device rows, host copies,
  per-expert resident tensors such as FP8 scales, and the map) so that rows [boundary, routed) hold the
  layer's coldest experts. Every swap is journalled, so a rollback restores all of them; undoing a
  committed transaction another rank refused replays its swaps inverted (`Residency.revert_last`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from vamp_sglang.memory.journal import Journal

HALFLIFE_STEPS = 2000.0  # the counts' half-life in observations (forward steps), as the bench's
EVERY_ROW = torch.iinfo(torch.int64).max  # the real-row bound where every top-k row is a token


class RoutingCounts:
    """Decayed selection counts `[layers, experts]` of logical experts, kept on the device."""

    def __init__(self, layers: int, experts: int, device: torch.device | str = "cpu",
                 halflife_steps: float = HALFLIFE_STEPS) -> None:
        if halflife_steps <= 0:
            raise ValueError(f"halflife_steps={halflife_steps} must be > 0")
        self.experts = experts
        self.decay = 0.5 ** (1.0 / halflife_steps)
        self._counts = torch.zeros(layers, experts + 1, dtype=torch.float32, device=device)  # + sentinel
        self._real_rows = torch.full((), EVERY_ROW, dtype=torch.int64, device=device)

    def set_real_tokens(self, tokens: int | None) -> None:
        """The coming forward's real token count (None: every row is a token), written in place into the
        device scalar that captured graphs read: eagerly before the forward, never inside a capture (SGLang
        captures through the model's forward, not `ModelRunner._forward_raw`, whose hook calls this). On
        CUDA a fill on the forward's stream, ordered before the replay with no host sync."""
        self._real_rows.fill_(EVERY_ROW if tokens is None else tokens)

    def observe(self, index: int, topk_ids: torch.Tensor) -> None:
        """Count one step's logical top-k ids `[rows, k]` of eligible layer `index`; rows at or past the
        step's real token count (CUDA-graph padding) and ids outside [0, E) (SGLang's -1 for rows it masks
        itself, non-local experts) land on a sentinel column. Device ops of fixed shape only, the real-row
        bound read from the device scalar: no host read, safe inside a CUDA graph."""
        ids = topk_ids.reshape(topk_ids.shape[0], -1).to(torch.int64)
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        real = (ids >= 0) & (ids < self.experts) & (rows < self._real_rows)
        ids = torch.where(real, ids, self.experts).reshape(-1)
        row = self._counts[index]
        row.mul_(self.decay)
        row.index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))

    def reset(self) -> None:
        """Forget every count, in place (captured graphs hold this tensor): at scheduler set-up, so graph
        capture's dummy batches do not weigh on the first offload's order."""
        self._counts.zero_()

    def agreed(self, group=None) -> torch.Tensor:
        """Every layer's counts `[layers, experts]` on the host, summed over the ranks of `group` (a CPU
        torch.distributed process group, or None for this rank alone), so every rank plans the same order."""
        counts = self._counts[:, :self.experts].cpu().clone()
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        return counts


class ExpertOrder:
    """Per eligible layer, `physical_of[logical]` (and its inverse) for the routed experts; rows at or
    above `routed` (fused shared experts) are never mapped."""

    def __init__(self, layers: int, routed: int, device: torch.device | str = "cpu") -> None:
        self.routed = routed
        self.logical_at = [list(range(routed)) for _ in range(layers)]  # host master: physical -> logical
        self.device_map = torch.arange(routed, device=device).repeat(layers, 1)  # logical -> physical

    def map_ids(self, index: int, topk_ids: torch.Tensor) -> None:
        """Rewrite logical top-k ids as physical rows in place; other ids (padding, shared experts) stay.
        Fixed-shape device ops on a fixed tensor, so a captured graph replays the live order."""
        ids = topk_ids.to(torch.int64)
        routed = (ids >= 0) & (ids < self.routed)
        mapped = self.device_map[index][ids.clamp(0, self.routed - 1)]
        topk_ids.copy_(torch.where(routed, mapped, ids).to(topk_ids.dtype))

    @property
    def permuted(self) -> bool:
        """Whether any layer's rows differ from the identity (ids must then be mapped before every kernel)."""
        return any(at != list(range(self.routed)) for at in self.logical_at)

    def digest(self) -> int:
        """A 48-bit digest of every layer's physical -> logical rows (exact as a float64 Prometheus gauge):
        ranks that summed the same counts hold equal ones, which `/metrics` shows per TP rank."""
        rows = b"".join(expert.to_bytes(4, "little") for at in self.logical_at for expert in at)
        return int.from_bytes(hashlib.blake2b(rows, digest_size=6).digest(), "little")

    def physical_of(self, index: int) -> list[int]:
        """Layer `index`'s logical -> physical map (host side)."""
        out = [0] * self.routed
        for row, expert in enumerate(self.logical_at[index]):
            out[expert] = row
        return out

    def swap(self, index: int, a: int, b: int) -> None:
        """Exchange what physical rows a and b hold, in the host master and the device map."""
        at = self.logical_at[index]
        at[a], at[b] = at[b], at[a]
        self.device_map[index, at[a]] = a
        self.device_map[index, at[b]] = b


def plan_swaps(counts: Sequence[float], logical_at: Sequence[int], boundary: int) -> list[tuple[int, int]]:
    """(resident row, offloaded row) pairs to exchange so that rows [boundary, routed) hold the coldest
    experts: the hottest offloaded expert trades places with the coldest resident one while it is
    strictly hotter (ties stay put, so equal counts never churn rows). Deterministic: ties by row."""
    routed = len(logical_at)
    resident = sorted(range(boundary), key=lambda r: (counts[logical_at[r]], r))
    offloaded = sorted(range(boundary, routed), key=lambda r: (-counts[logical_at[r]], r))
    pairs = []
    for low, high in zip(resident, offloaded):
        if counts[logical_at[high]] <= counts[logical_at[low]]:
            break
        pairs.append((low, high))
    return pairs


class ExpertRows:
    """One layer's expert rows wherever they live: the device tensors `[E, ...]`, their host copies of rows
    [host_offset, routed), and resident per-expert tensors (FP8 block scales) that only live on the device.
    A row at or above the staging boundary is read from the host copy (its device pages alias a staging
    slot); a row below the host offset has no host copy."""

    def __init__(self, device: Sequence[torch.Tensor], host: Sequence[torch.Tensor], routed: int,
                 resident: Sequence[torch.Tensor] = ()) -> None:
        if len(device) != len(host):
            raise ValueError(f"{len(device)} device weights, {len(host)} host copies")
        self.device, self.host, self.resident = list(device), list(host), list(resident)
        self.routed = routed

    def swap(self, a: int, b: int, boundary: int) -> int:
        """Exchange the contents of rows a and b with `boundary` the first staged row; returns the expert
        bytes exchanged (both rows' weights, once each, wherever they were written)."""
        moved = 0
        for device, host in zip(self.device, self.host):
            offset = self.routed - host.shape[0]
            rows = [(host[r - offset] if r >= boundary else device[r]).clone() for r in (a, b)]
            for r, content in ((a, rows[1]), (b, rows[0])):
                if r < boundary:
                    device[r].copy_(content)
                if r >= offset:
                    host[r - offset].copy_(content)
                moved += content.numel() * content.element_size()
        for tensor in self.resident:
            tensor[[a, b]] = tensor[[b, a]]
        return moved


def exchange(order: ExpertOrder, index: int, rows: ExpertRows, a: int, b: int, resident_end: int,
             journal: Journal) -> int:
    """Inside a transaction: swap what rows a and b of layer `index` hold (map, rows, host copies), rows
    [0, resident_end) on the device; journalled with its inverse (the same swap). Returns the bytes."""
    def swap() -> int:
        order.swap(index, a, b)
        return rows.swap(a, b, resident_end)

    return journal.run(swap, lambda _: swap())


def reorder_rows(order: ExpertOrder, index: int, rows: ExpertRows, counts: torch.Tensor, resident_end: int,
                 target_boundary: int, journal: Journal) -> tuple[int, list[tuple[int, int]]]:
    """Inside a transaction: swap layer `index`'s rows so [target_boundary, routed) hold its coldest experts
    by `counts` (logical), while rows [0, resident_end) are on the device (for an offload: before its pages
    leave; for a restore: after its rows came back). Each swap is journalled, so a rollback leaves rows,
    host copies and map as they were. Returns the bytes moved and the (row, row) pairs swapped."""
    if not 0 <= target_boundary <= resident_end <= order.routed:
        raise ValueError(f"boundaries {target_boundary} <= {resident_end} <= {order.routed} do not hold")
    pairs = plan_swaps(counts.tolist(), order.logical_at[index], target_boundary)
    return sum(exchange(order, index, rows, a, b, resident_end, journal) for a, b in pairs), pairs


class Residency:
    """Residency by routing for a model's eligible layers: what the MoE path calls per layer and step
    (`route`), what an offload or restore transaction calls (`reorder`), and the `/vamp/stats` figures.
    `rows[i]` is eligible layer i's ExpertRows; `group` the CPU process group whose ranks hold the same
    experts (TP without expert parallelism), None for a rank whose experts are its own."""

    def __init__(self, rows: Sequence[ExpertRows], device: torch.device | str = "cpu", group=None,
                 halflife_steps: float = HALFLIFE_STEPS) -> None:
        routed = rows[0].routed
        self.rows, self.group = list(rows), group
        self.counts = RoutingCounts(len(rows), routed, device, halflife_steps)
        self.order = ExpertOrder(len(rows), routed, device)
        self.without_ids: set[int] = set()  # eligible layers that reached their kernel without top-k ids
        self.swaps = self.swapped_bytes = 0
        self.offloaded_share = self.offloaded_share_by_index = 0.0  # at the last reorder
        self.coldest = True  # whether, at the last reorder, every layer's offloaded rows held its coldest
        self._last: tuple | None = None  # the last committed reorder: (swaps, bytes, figures before it)

    def route(self, index: int, topk_ids: torch.Tensor | None) -> None:
        """Count layer `index`'s logical ids (the step's real token rows only: `RoutingCounts.observe`)
        and map every row's ids to physical rows in place, before its kernel."""
        if topk_ids is None:
            if self.order.permuted:
                raise RuntimeError(f"eligible MoE layer {index} runs without top-k ids while experts are "
                                   f"reordered: its kernel would read the wrong rows")
            self.without_ids.add(index)
            return
        self.counts.observe(index, topk_ids)
        self.order.map_ids(index, topk_ids)

    def agree(self) -> torch.Tensor | None:
        """The counts every rank of `group` plans from (their sum), or None while some layer has no ids to
        map. A collective: every rank calls it at the same point of a transaction, before any step that may
        fail on one rank alone (a rank that left the transaction would leave the others waiting here).
        Never in an undo (`revert_last`): only the ranks that applied a refused round undo it."""
        return None if self.without_ids else self.counts.agreed(self.group)

    def reorder(self, journal: Journal, resident_end: int, target_boundary: int,
                counts: torch.Tensor | None) -> int:
        """Inside a transaction: every layer's rows [target_boundary, routed) to its coldest experts by
        `counts` (from `agree`; None: nothing moves). Its swaps become the ones `revert_last` undoes, and
        every figure here is journalled, so a rollback leaves the stats of the plan still in place.
        Returns the bytes moved."""
        figures, moved, swaps = self._figures(), 0, []
        for index, rows in enumerate(self.rows if counts is not None else ()):
            step_moved, pairs = reorder_rows(self.order, index, rows, counts[index], resident_end,
                                             target_boundary, journal)
            moved += step_moved
            swaps += [(index, a, b) for a, b in pairs]
        journal.record(lambda: self._set_figures(figures))
        if counts is not None:
            self._note(counts, target_boundary)
        self.swaps += len(swaps)
        self.swapped_bytes += moved
        self._last = (swaps, moved, figures)
        return moved

    def revert_last(self, journal: Journal, resident_end: int) -> int:
        """Inside an undo transaction (ExpertMemory.return_to, a round another rank refused): the last
        committed reorder's swaps inverted, newest first, with no collective, so this rank ends in the order
        and with the figures it had before the round. A second undo transaction of the same round (a
        restore from both pools is undone by two offloads) finds nothing left to revert. Returns the bytes."""
        if self._last is None:
            return 0
        figures, (swaps, moved, before) = self._figures(), self._last
        journal.record(lambda: self._set_figures(figures))
        back = sum(exchange(self.order, index, self.rows[index], a, b, resident_end, journal)
                   for index, a, b in reversed(swaps))
        self._set_figures(before)
        self.swaps -= len(swaps)
        self.swapped_bytes -= moved
        self._last = None
        return back

    def _figures(self) -> tuple:
        return (self.swaps, self.swapped_bytes, self.offloaded_share, self.offloaded_share_by_index,
                self.coldest, self._last)

    def _set_figures(self, figures: tuple) -> None:
        (self.swaps, self.swapped_bytes, self.offloaded_share, self.offloaded_share_by_index, self.coldest,
         self._last) = figures

    def _note(self, counts: torch.Tensor, boundary: int) -> None:
        total = counts.sum().item()
        held = sum(counts[i, at[boundary:]].sum().item() for i, at in enumerate(self.order.logical_at))
        self.offloaded_share = held / total if total else 0.0
        self.offloaded_share_by_index = counts[:, boundary:].sum().item() / total if total else 0.0
        self.coldest = all(not boundary or not at[boundary:]
                           or counts[i, at[boundary:]].max() <= counts[i, at[:boundary]].min()
                           for i, at in enumerate(self.order.logical_at))

    def stats(self) -> dict:
        """The `/vamp/stats` `residency` figures."""
        return {"order": "routing", "swaps": self.swaps, "swapped_bytes": self.swapped_bytes,
                "offloaded_share": round(self.offloaded_share, 4),
                "offloaded_share_by_index": round(self.offloaded_share_by_index, 4),
                "offloaded_are_coldest": self.coldest, "layers_without_ids": sorted(self.without_ids),
                "order_digest": self.order.digest()}
