"""Residency by routing counts only the step's real token rows (issue 49): a CUDA graph replayed at a larger
batch (decode at batch 9 replays the batch-16 graph) routes its padding rows like tokens under plain TP, and
`Residency.route` runs inside the captured segment, so it cannot slice by a host count; the counts mask the
rows past a device scalar that the forward-start hook writes from `StagingEngine.real_tokens`. The stand-in
for padding: rows at or past T route to expert E-1, which must stay uncounted."""

from types import SimpleNamespace

import torch

from vamp_sglang.integration.memory import expert_memory_hooks as hooks
from vamp_sglang.integration.staging import expert_order
from vamp_sglang.memory.residency import ExpertRows, Residency, RoutingCounts
from vamp_sglang.memory.staging import StagingEngine

EXPERTS, TOP_K, ROWS, REAL = 8, 2, 16, 9  # a batch of 9 replayed in the 16-row graph


def padded_ids(rows: int = ROWS, real: int = REAL) -> torch.Tensor:
    """Real rows pick experts 0..E-2 (two distinct per row), padding rows pick E-1 in every slot."""
    ids = torch.full((rows, TOP_K), EXPERTS - 1, dtype=torch.int32)
    first = torch.arange(real) % (EXPERTS - 1)
    ids[:real, 0], ids[:real, 1] = first, (first + 1) % (EXPERTS - 1)
    return ids


def test_rows_past_the_real_count_are_not_counted():
    counts = RoutingCounts(1, EXPERTS, halflife_steps=1e9)
    counts.set_real_tokens(REAL)
    ids = padded_ids()
    counts.observe(0, ids)
    got = counts.agreed()[0]
    assert got[EXPERTS - 1] == 0
    assert torch.allclose(got, torch.bincount(ids[:REAL].reshape(-1).long(), minlength=EXPERTS).float())


def test_the_bound_is_read_at_each_step_and_none_counts_every_row():
    """One set of ids (the capture-time buffer a replay refills), the bound changed between steps."""
    counts = RoutingCounts(1, EXPERTS, halflife_steps=1e9)
    scalar = counts._real_rows.data_ptr()
    ids = padded_ids()
    counts.observe(0, ids)  # never told: every row is a token, as before any forward
    assert counts.agreed()[0, EXPERTS - 1] == (ROWS - REAL) * TOP_K
    counts.reset()
    for real in (REAL, ROWS, 3):
        counts.set_real_tokens(real)
        counts.observe(0, ids)
    assert counts._real_rows.data_ptr() == scalar  # written in place: captured graphs hold its address
    assert counts.agreed()[0, EXPERTS - 1] == (ROWS - REAL) * TOP_K  # counted once, at the 16-row step
    assert counts.agreed().sum() == (REAL + ROWS + 3) * TOP_K
    counts.set_real_tokens(None)
    counts.observe(0, ids)
    assert counts.agreed()[0, EXPERTS - 1] == 2 * (ROWS - REAL) * TOP_K


def test_observe_reads_nothing_on_the_host():
    """On the meta device any host read or data-dependent shape raises: the count is capturable."""
    counts = RoutingCounts(2, EXPERTS, device="meta")
    counts.set_real_tokens(REAL)
    counts.observe(1, padded_ids().to("meta"))
    assert counts._counts.shape == (2, EXPERTS + 1)


def model_experts(trim_padding: bool) -> SimpleNamespace:
    w13, w2 = torch.zeros(EXPERTS, 4, 2), torch.zeros(EXPERTS, 2, 2)
    rows = ExpertRows([w13, w2], [w13[EXPERTS // 2:].clone(), w2[EXPERTS // 2:].clone()], EXPERTS)
    return SimpleNamespace(engine=StagingEngine([], trim_padding=trim_padding),
                           residency=Residency([rows], halflife_steps=1e9))


def test_the_forward_start_hook_bounds_the_count(monkeypatch):
    experts = model_experts(trim_padding=True)
    monkeypatch.setattr(hooks, "_process", SimpleNamespace(experts=experts))
    hooks._before_forward_raw(SimpleNamespace(is_draft_worker=False),
                              SimpleNamespace(input_ids=torch.zeros(REAL, dtype=torch.int64)))
    hooks._before_forward_raw(SimpleNamespace(is_draft_worker=True),  # a draft's forward leaves it
                              SimpleNamespace(input_ids=torch.zeros(ROWS, dtype=torch.int64)))
    ids = padded_ids()
    experts.residency.route(0, ids)
    assert experts.residency.counts.agreed()[0, EXPERTS - 1] == 0
    assert experts.residency.counts.agreed().sum() == REAL * TOP_K


def test_rows_that_are_not_this_ranks_tokens_all_count():
    """Under DP attention or an all-to-all dispatcher (`moe_sees_local_tokens` false, no trim) the real
    rows are not a prefix of the MoE's rows, so none is masked here, as routed staging trims none."""
    experts = model_experts(trim_padding=False)
    experts.engine.begin_forward(REAL)
    expert_order.count_real_rows(experts)
    experts.residency.route(0, padded_ids())
    assert experts.residency.counts.agreed().sum() == ROWS * TOP_K
