"""The MLP-sync column (integration/decisions/dp_peers.py) on SGLang's own MLPSyncBatchInfo: each rank's row carries the
groups it offloaded, an absent rank's idle row carries 0, and after the gather a rank reads the most any
other DP rank offloaded (its own row left out). The gather itself runs over gloo in the DP server test."""

import pytest
import torch

from vamp_sglang.integration.decisions import dp_peers
from vamp_sglang.policy import DpStep

MLPSyncBatchInfo = pytest.importorskip("sglang.srt.managers.scheduler_components.dp_attn").MLPSyncBatchInfo


def _info(num_tokens):
    return MLPSyncBatchInfo(num_dp_ranks=3, tp_size=1, cp_size=1, num_tokens=num_tokens,
                            num_tokens_for_logprob=num_tokens, can_run_decode_cuda_graph=False,
                            can_run_draft_cuda_graph=False, can_run_prefill_cuda_graph=False,
                            is_extend_in_batch=True, local_can_run_tbo=False, local_forward_mode=1)


def _row(info, offloaded_groups, monkeypatch):
    monkeypatch.setattr(dp_peers, "_offloaded_groups", lambda: offloaded_groups)
    return dp_peers._around_local_row(MLPSyncBatchInfo._get_local_tensor, info, device="cpu")


def test_the_row_gains_one_last_column_and_sglangs_columns_stay_where_they_were(monkeypatch):
    info = _info(5)
    plain = MLPSyncBatchInfo._get_local_tensor(info, device="cpu")
    row = _row(info, 7, monkeypatch)
    assert row.tolist() == plain.tolist() + [7] and row.dtype == plain.dtype
    fallback = dp_peers._around_fallback_row(MLPSyncBatchInfo._get_fallback_tensor, info, device="cpu")
    assert fallback.tolist() == MLPSyncBatchInfo._get_fallback_tensor(info, device="cpu").tolist() + [0]
    monkeypatch.undo()  # nothing watched: VAMP off on this rank's experts, or not set up yet
    assert dp_peers._around_local_row(MLPSyncBatchInfo._get_local_tensor, info, device="cpu")[-1] == 0


def test_after_the_gather_a_rank_reads_the_most_another_dp_rank_offloaded(monkeypatch):
    import types

    from sglang.srt import runtime_context

    def as_dp_rank(rank):  # SGLang's own override validates against whatever groups earlier tests built
        monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(attn_dp_rank=rank))

    monkeypatch.setattr(dp_peers, "_peer_offloaded_groups", None)
    assert dp_peers.dp_step(4) is None  # no gather yet: no DP attention as far as the snapshot knows
    rows = [_row(_info(n), groups, monkeypatch) for n, groups in [(5, 4), (0, 12), (2, 8)]]
    info = _info(5)
    info.tp0_info_cpu = torch.stack(rows)  # what all_gather leaves: one row per DP rank, in rank order
    as_dp_rank(1)
    dp_peers._after_all_gather(None, info)
    assert dp_peers.peer_offloaded_groups() == 8  # rank 1's own 12 is not a peer's
    assert dp_peers.dp_step(12) == DpStep(offloaded_groups=12, peer_offloaded_groups=8)
    as_dp_rank(0)
    dp_peers._after_all_gather(None, info)
    assert dp_peers.peer_offloaded_groups() == 12
