"""DP attention: what the other DP ranks have offloaded, carried by SGLang's per-step MLP-sync all-gather.

Every DP rank joins every MoE layer (an idle rank runs an idle batch), so the step waits for whichever rank
stages the most offloaded experts; a decision prices C_e only for what it adds above the other ranks
(policy/costs.dp_charged_groups), and a restore over the TPOT SLO is left to the rank that stages most
(policy/restore). Before each step SGLang all-gathers one small int row per rank over the TP group
(`MLPSyncBatchInfo.all_gather`, managers/scheduler_components/dp_attn.py); we append one column to that
row, the groups this rank has offloaded, so the count rides a collective SGLang runs anyway. SGLang reads
its columns by index and sizes the gathered tensor from the local row, so the extra last column is seen
by no one else; every rank of the server appends it (the hooks are placed in every scheduler process),
so the rows keep one width. The idle rows SGLang fills in for absent ranks carry 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vamp_sglang.integration.hooks import Hook
from vamp_sglang.policy import DpStep

_peer_offloaded_groups: int | None = None  # None until a gather across several DP ranks came back
_offloaded_groups: Callable[[], int] = lambda: 0  # this rank's count, once its experts are paged


def watch(offloaded_groups: Callable[[], int]) -> None:
    """Publish this rank's offloaded groups from now on (decision_hooks.setup_scheduler, VAMP on)."""
    global _offloaded_groups
    _offloaded_groups = offloaded_groups


def peer_offloaded_groups() -> int | None:
    """The most groups any other DP rank had offloaded at the last gathered step (None: no DP attention)."""
    return _peer_offloaded_groups


def dp_step(offloaded_groups: int) -> DpStep | None:
    """The snapshot's DP input, or None where no other DP rank exists."""
    peers = _peer_offloaded_groups
    return None if peers is None else DpStep(offloaded_groups=offloaded_groups, peer_offloaded_groups=peers)


def _with_column(row: Any, value: int) -> Any:
    import torch

    return torch.cat((row, row.new_tensor([value])))


def _around_local_row(original: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
    return _with_column(original(info, *args, **kwargs), int(_offloaded_groups()))


def _around_fallback_row(original: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
    return _with_column(original(info, *args, **kwargs), 0)


def _after_all_gather(result: Any, info: Any, *args: Any, **kwargs: Any) -> None:
    global _peer_offloaded_groups
    from sglang.srt.runtime_context import get_parallel

    counts = info.tp0_info_cpu[:, -1].tolist()  # one row per DP rank, from its attention-TP rank 0
    own = get_parallel().attn_dp_rank
    _peer_offloaded_groups = max((int(n) for rank, n in enumerate(counts) if rank != own), default=0)


_SYNC = "sglang.srt.managers.scheduler_components.dp_attn.MLPSyncBatchInfo"
HOOKS = [
    Hook(f"{_SYNC}._get_local_tensor", "around", _around_local_row,
         "DP attention: one more column in the per-step MLP-sync row, the groups this rank has offloaded"),
    Hook(f"{_SYNC}._get_fallback_tensor", "around", _around_fallback_row,
         "DP attention: the idle row of an absent rank gets the same column (0 groups)"),
    Hook(f"{_SYNC}.all_gather", "after", _after_all_gather,
         "DP attention: read the other DP ranks' offloaded groups, so C_e counts only what a rank adds"),
]
