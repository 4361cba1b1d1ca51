# ruff: noqa: F811  (tests take the imported `model` fixture as an argument)
"""Routed-only staging and the per-step choice (issue 12), on the real StagingEngine over host pages:
outputs bit-identical to the unpaged reference in every mode and across mode switches, routed steps copy
exactly the routed offloaded rows and prefetch nothing, and the choice follows its measured inputs."""

import pytest
import torch
from test_staging import EXPERTS, HIDDEN, LAYERS, TOP_K, model, offload  # noqa: F401 (model: test_staging's fixture)

from eval.bench_memory import moe_forward
from vamp_sglang.memory.routed import (
    device_copy_list,
    expected_routed_fraction,
    host_offset,
    routed_offloaded_runs,
)
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_choice import ROUTED, WHOLE, StagingChooser


def forward(x, weights, stores, engine=None, routed=None):
    """Residual MoE stack; the engine gets the token count and each layer's top-k ids, as the glue
    passes them. `routed[lid]` collects the ids each layer's router selected."""
    tensors = {lid: w[:2] for lid, w in weights.items()} | {s.layer_id: (s.w13, s.w2) for s in stores}
    if engine is not None:
        engine.begin_forward(x.shape[0])
    for lid in LAYERS:
        ids = torch.topk(x @ weights[lid][2].T, TOP_K).indices
        if routed is not None:
            routed[lid] = set(ids.flatten().tolist())
        if engine is not None:
            engine.before_moe(lid, ids)
        x = x + moe_forward(x, weights[lid][2], *tensors[lid], TOP_K)
        if engine is not None:
            engine.after_moe(lid)
    return x


def row_bytes(store):
    return (store.w13[0].numel() + store.w2[0].numel()) * 4


@pytest.mark.parametrize("ratio", [0.10, 0.25, "max"])
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_routed_steps_are_bit_identical_and_copy_exactly_the_routed_offloaded_rows(model, ratio, tokens):
    _backend, weights, layout, stores = model
    groups = layout.bound_groups if ratio == "max" else layout.groups_for_ratio(ratio)
    offload(stores, groups)
    boundary = layout.boundary_expert(groups)
    engine = StagingEngine(stores, "async", staging="routed")
    for seed in range(3):  # each step's slots hold the previous step's rows: only the copy makes them right
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(10 + seed))
        before = engine.stats().bytes_staged
        routed: dict[int, set[int]] = {}
        assert torch.equal(forward(x, weights, stores, engine, routed), forward(x, weights, []))
        want = sum(len({e for e in routed[s.layer_id] if e >= boundary}) * row_bytes(s) for s in stores)
        assert engine.stats().bytes_staged - before == want
    stats = engine.stats()
    assert stats.unprefetched == 0 and stats.by_mode[ROUTED]["steps"] == 3 and stats.by_mode[WHOLE]["steps"] == 0
    assert stats.by_mode[ROUTED]["bytes"] == stats.bytes_staged
    assert stats.wait_s == pytest.approx(stats.copy_s)  # not overlapped: every copied second is waited
    engine.close()


def test_routed_step_without_its_copy_reads_stale_rows(model):
    """The routed copy is what makes the output right: with the ids withheld from one layer (None, so
    it falls back to a whole copy) it stays right; with the copy skipped it does not."""
    _backend, weights, layout, stores = model
    offload(stores, layout.bound_groups)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(5))
    reference = forward(x, weights, [])
    engine = StagingEngine(stores, "async", staging="routed")
    assert torch.equal(forward(x, weights, stores, engine), reference)
    y = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(6))
    engine.begin_forward(16)  # a step whose layers never get their routed copy
    out = y
    for lid in LAYERS:
        out = out + moe_forward(out, weights[lid][2], *({s.layer_id: (s.w13, s.w2) for s in stores}.get(
            lid, weights[lid][:2])), TOP_K)
    assert not torch.equal(out, forward(y, weights, []))
    engine.close()


def test_whole_and_routed_steps_mix_and_every_step_is_identical(model):
    _backend, weights, layout, stores = model
    offload(stores, layout.groups_for_ratio(0.25))
    engine = StagingEngine(stores, "async", staging="routed")
    for step, tokens in enumerate([4, 64, 1, 16, 4, 64]):
        engine.chooser.policy = (WHOLE, ROUTED)[step % 2]
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(step))
        assert torch.equal(forward(x, weights, stores, engine), forward(x, weights, []))
    stats = engine.stats()
    assert stats.by_mode[WHOLE]["steps"] == stats.by_mode[ROUTED]["steps"] == 3
    assert stats.by_mode[WHOLE]["bytes"] == 3 * sum(s.staged_bytes() for s in stores)
    assert stats.by_mode[WHOLE]["bytes"] + stats.by_mode[ROUTED]["bytes"] == stats.bytes_staged
    engine.close()


def test_auto_measures_whole_first_and_every_step_is_identical(model):
    _backend, weights, layout, stores = model
    offload(stores, layout.groups_for_ratio(0.25))
    engine = StagingEngine(stores, "async", staging="auto", top_k=TOP_K)
    for step in range(6):
        x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(step))
        assert torch.equal(forward(x, weights, stores, engine), forward(x, weights, []))
        if step == 0:
            assert engine.stats().by_mode[WHOLE]["steps"] == 1  # the first step of a bucket measures whole
    stats = engine.stats()
    assert stats.by_mode[WHOLE]["steps"] + stats.by_mode[ROUTED]["steps"] == stats.steps == 6
    assert engine.chooser.whole_bw_bytes_per_s > 0
    engine.close()


def test_nothing_offloaded_stages_nothing_in_any_mode(model):
    _backend, weights, _layout, stores = model
    for policy in ("routed", "auto"):
        engine = StagingEngine(stores, "async", staging=policy, top_k=TOP_K)
        x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1))
        assert torch.equal(forward(x, weights, stores, engine), forward(x, weights, []))
        assert engine.stats().bytes_staged == 0 and engine.stats().copies == 0
        engine.close()


def ep_local_ids(tokens, ep_size, generator):
    """Rank 0's top-k ids under expert parallelism: uniform top-k over all EXPERTS * ep_size routed experts,
    those of other ranks as -1 (SGLang's local mapping for the standard dispatcher)."""
    ids = torch.rand(tokens, EXPERTS * ep_size, generator=generator).topk(TOP_K).indices
    return torch.where(ids < EXPERTS, ids, -1)


def test_under_ep_the_expected_routed_rows_count_every_rank_s_experts(model):
    """Issue 45: a rank's stores hold its routed/ep local experts, but the router picks among all of them.
    Under uniform routing the estimate over the global count needs no correction (observed/expected ~ 1);
    one over the local count expected about ep times the rows actually routed."""
    _backend, _weights, layout, stores = model
    offload(stores, layout.bound_groups)
    ep_size, tokens, generator = 2, 4, torch.Generator().manual_seed(7)
    engine = StagingEngine(stores, "sync", staging="routed", top_k=TOP_K, ep_size=ep_size)
    offloaded_rows = stores[0].routed_experts - stores[0].boundary_expert
    assert engine.chooser.expected_rows(tokens, offloaded_rows) == pytest.approx(
        offloaded_rows * (1 - (1 - TOP_K / (EXPERTS * ep_size)) ** tokens))
    for _ in range(200):
        engine.begin_forward(tokens)
        for lid in LAYERS:
            engine.before_moe(lid, ep_local_ids(tokens, ep_size, generator))
            engine.after_moe(lid)
    engine.begin_forward(tokens)  # reads the last step's copies
    assert engine.chooser.routed_ratio == pytest.approx(1.0, abs=0.2)
    with pytest.raises(ValueError, match="ep_size"):
        StagingEngine(stores, "sync", ep_size=0)
    engine.close()


def test_expected_routed_fraction_is_one_minus_miss_probability_to_the_tokens():
    assert expected_routed_fraction(2, 128, 4) == pytest.approx(1 - (126 / 128) ** 4)  # tiny model: ~6%
    assert expected_routed_fraction(2, 128, 4) == pytest.approx(0.0611, abs=1e-3)
    assert expected_routed_fraction(10, 512, 16) == pytest.approx(0.27, abs=0.01)  # Qwen3-Next, 16 tokens
    assert expected_routed_fraction(2, 128, 0) == 0.0 and expected_routed_fraction(8, 8, 1) == 1.0


def test_routed_runs_are_the_selected_offloaded_ids_grouped():
    ids = torch.tensor([[3, 30], [31, 39], [-1, 33], [32, 2]])
    assert routed_offloaded_runs(ids, 30, 40) == [(30, 34), (39, 40)]
    assert routed_offloaded_runs(ids, 40, 40) == []


@pytest.mark.parametrize("boundary", [20, 35, 40])
def test_device_copy_list_matches_the_host_runs(boundary):
    """The graph-safe list (device ops only) names the same rows as the host path; CPU tensors here,
    the same ops run on CUDA (tests/test_staging_routed_gpu.py, eval/gpu_check.py)."""
    experts, host_rows = 40, 20
    ids = torch.tensor([[3, 30], [31, 39], [-1, 33], [32, 21]])
    src, dst = torch.full((host_rows,), -7, dtype=torch.int32), torch.full((host_rows,), -7, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    device_copy_list(ids, boundary, experts, experts - host_rows, src, dst, count)
    want = [e for first, end in routed_offloaded_runs(ids, boundary, experts) for e in range(first, end)]
    n = int(count[0])
    assert dst[:n].tolist() == want and src[:n].tolist() == [e - (experts - host_rows) for e in want]


def test_host_offset_is_the_first_host_row(model):
    _backend, _weights, layout, stores = model
    assert host_offset(stores[0]) == EXPERTS - stores[0].host_w13.shape[0] == EXPERTS - layout.bound_groups * \
        layout.group_experts


def test_choice_explores_whole_then_picks_the_cheaper_mode_from_its_measurements():
    chooser = StagingChooser("auto", top_k=2, experts=128, explore_every_steps=10)
    whole, rows, row = 32 * 1000, 32, 1000  # one layer: 32 offloaded rows of 1000 bytes
    assert chooser.choose(1, 4, whole, rows, row) == WHOLE  # nothing measured yet
    chooser.observe_whole(1, 4, whole, copy_s=32e-6, wait_s=30e-6)  # 1 GB/s, a 2 us window: exposed
    assert chooser.whole_s(4, whole) == pytest.approx(30e-6)
    assert chooser.routed_s(4, rows, row) == pytest.approx(rows * expected_routed_fraction(2, 128, 4) * 1e-6)
    assert chooser.choose(2, 4, whole, rows, row) == ROUTED
    assert chooser.choose(2, 256, whole, rows, row) == WHOLE  # another bucket: measure whole first
    chooser.observe_whole(2, 256, whole, copy_s=32e-6, wait_s=0.0)  # hidden by a long window
    assert chooser.choose(3, 256, whole, rows, row) == WHOLE
    assert chooser.choose(11, 4, whole, rows, row) == WHOLE  # re-measure whole every 10 steps of a bucket
    assert chooser.choose(1, None, whole, rows, row) == WHOLE and chooser.choose(5, 4, 0, 0, row) == WHOLE


def test_observed_routing_skew_scales_the_expected_rows():
    chooser = StagingChooser("auto", top_k=2, experts=128)
    uniform = chooser.expected_rows(4, 32)
    for _ in range(50):
        chooser.observe_routed(4, 2000, 1e-6, rows=round(2 * uniform), offloaded_rows=32)
    assert chooser.expected_rows(4, 32) == pytest.approx(2 * uniform, rel=0.05)
    assert chooser.expected_rows(10_000, 32) == 32  # never more than the region


def test_fixed_policies_and_bad_ones():
    assert StagingChooser("routed", None, 128).choose(1, 4, 10, 10, 1) == ROUTED
    assert StagingChooser("whole", None, 128).choose(1, 4, 10, 10, 1) == WHOLE
    with pytest.raises(ValueError, match="staging policy"):
        StagingChooser("fast", 2, 128)
    with pytest.raises(ValueError, match="top_k"):
        StagingChooser("auto", None, 128)


def test_on_the_host_measured_step_times_decide_once_both_modes_ran():
    """The host's whole copy shares the memory bus with the compute it overlaps, which the window model
    cannot see: each bucket tries routed once, then the faster measured mode runs, the slower one
    re-measured every explore_every_steps steps."""
    chooser = StagingChooser("auto", top_k=2, experts=128, explore_every_steps=10, measure_steps=True)
    whole, rows, row = 32 * 1000, 32, 1000
    assert chooser.choose(1, 64, whole, rows, row) == WHOLE
    chooser.observe_whole(1, 64, whole, copy_s=32e-6, wait_s=0.0)  # fully hidden: the model says whole
    chooser.observe_step(1, 64, WHOLE, 0.010)
    assert chooser.choose(2, 64, whole, rows, row) == ROUTED  # but routed is tried once
    chooser.observe_step(2, 64, ROUTED, 0.008)
    assert [chooser.choose(s, 64, whole, rows, row) for s in (3, 5, 10)] == [ROUTED, ROUTED, ROUTED]
    assert chooser.choose(11, 64, whole, rows, row) == WHOLE  # whole re-measured after 10 steps
    chooser.observe_whole(11, 64, whole, copy_s=32e-6, wait_s=0.0)
    chooser.observe_step(11, 64, WHOLE, 0.006)
    assert chooser.choose(12, 64, whole, rows, row) == ROUTED  # whole (11) was 9 steps from routed (2): not compared
    for step in range(13, 30):
        chooser.observe_step(step, 64, WHOLE, 0.004)
        chooser.observe_whole(step, 64, whole, copy_s=32e-6, wait_s=0.0)
    assert chooser.choose(30, 64, whole, rows, row) == ROUTED  # routed last ran at step 2: re-measure it
    chooser.observe_step(30, 64, ROUTED, 0.008)
    assert chooser.choose(31, 64, whole, rows, row) == WHOLE  # now the faster one
