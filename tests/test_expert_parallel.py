"""VAMP with expert parallelism (`--ep-size` > 1, the standard dispatcher), without a server.

- Each rank pages its own local experts, whole experts at full width: groups are sized in bytes, so a
  group is whole pages at any ep and a rank frees the same bytes per group under TP and under EP.
- Routed staging ignores the -1 ids SGLang's standard dispatcher gives other ranks' experts (a -1 used
  as an index would pick the last local expert, an offloaded one).
- C_e's c_reload is agreed as the slowest rank's (the step waits for the MoE all-reduce).
- The launcher serves `--ep-size` > 1 with VAMP on and the a2a backend `none`, and still refuses the others.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_integration_memory import GRAN, RATIO, make_layers, sglang_moe  # noqa: F401 (sglang_moe: fixture)
from test_staging import HIDDEN, model, offload  # noqa: F401 (model: test_staging's fixture)

from tests.test_decisions import on_both, two_ranks  # noqa: F401 (fixture)
from vamp_sglang.config import ConfigError, VampConfig
from vamp_sglang.integration.decisions.plan_inputs import PlanInputs
from vamp_sglang.launch_server import prepare
from vamp_sglang.memory.layout import ExpertLayout
from vamp_sglang.memory.routed import device_copy_list, routed_offloaded_runs
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.policy import Coefficients

PAGE = 2 << 20
TINY = {"experts": 128, "hidden": 256, "inter": 256, "dtype_bytes": 4}  # vamp_sglang.tiny_moe's qwen3_moe


def rank_layout(tp: int, ep: int, ratio: float = 0.2) -> ExpertLayout:
    """One rank's layout of the tiny Qwen3-MoE as SGLang shards it: E/ep local experts, each cut on the
    intermediate dimension by tp/ep (fused_moe_triton/layer.py:390-428)."""
    inter = TINY["inter"] // (tp // ep)
    return ExpertLayout.compute(
        moe_layer_ids=list(range(6)), local_experts=TINY["experts"] // ep,
        w13_shard_bytes=2 * inter * TINY["hidden"] * TINY["dtype_bytes"],
        w2_shard_bytes=inter * TINY["hidden"] * TINY["dtype_bytes"], granularity_bytes=PAGE,
        max_offload_ratio=ratio, staging_capacity_shards=TINY["experts"] // ep)


@pytest.mark.parametrize("tp, ep", [(2, 2), (4, 2), (4, 4), (8, 8)])
def test_a_group_is_whole_pages_and_frees_what_it_frees_under_tp(tp, ep):
    tp_only, with_ep = rank_layout(tp, 1), rank_layout(tp, ep)
    assert with_ep.group_experts * with_ep.w13_shard_bytes % PAGE == 0
    assert with_ep.group_experts * with_ep.w2_shard_bytes % PAGE == 0
    assert with_ep.group_experts == tp_only.group_experts // ep  # ep times fewer, ep times wider experts
    assert with_ep.bytes_freed_per_group == tp_only.bytes_freed_per_group
    assert with_ep.bound_groups == tp_only.bound_groups


def test_routed_runs_ignore_other_ranks_ids():
    ids = torch.tensor([[-1, 3], [-1, -1], [5, -1]])
    assert routed_offloaded_runs(ids, boundary=4, experts=8) == [(5, 6)]  # not 7, the row -1 indexes
    assert routed_offloaded_runs(torch.full((3, 2), -1), boundary=4, experts=8) == []


def test_device_copy_list_ignores_other_ranks_ids():
    ids = torch.tensor([[-1, 6], [-1, -1], [5, -1]], dtype=torch.int32)
    src, dst, count = (torch.zeros(8, dtype=torch.int32) for _ in range(3))
    device_copy_list(ids, boundary=4, experts=8, offset=2, src=src, dst=dst, count=count)
    assert int(count[0]) == 2 and dst[:2].tolist() == [5, 6] and src[:2].tolist() == [3, 4]
    device_copy_list(torch.full((2, 2), -1, dtype=torch.int32), 4, 8, 2, src, dst, count)
    assert int(count[0]) == 0


def test_a_routed_step_copies_no_row_for_other_ranks_ids(model):  # noqa: F811
    """The engine's host path, as `run_moe_core` hands it an EP rank's dispatched ids."""
    _backend, _weights, layout, stores = model
    offload(stores, layout.bound_groups)
    boundary = layout.boundary_expert(layout.bound_groups)
    engine = StagingEngine(stores, "async", staging="routed")
    row = (stores[0].w13[0].numel() + stores[0].w2[0].numel()) * stores[0].w13.element_size()
    engine.begin_forward(4)
    last = layout.routed_experts - 1
    stores[0].w13[last].fill_(7.0)  # the row a -1 index would pick: a copy would overwrite it
    before = engine.stats().bytes_staged
    engine.before_moe(stores[0].layer_id, torch.full((4, 2), -1))
    engine.after_moe(stores[0].layer_id)
    assert engine.stats().bytes_staged == before and bool((stores[0].w13[last] == 7.0).all())
    engine.before_moe(stores[1].layer_id, torch.tensor([[-1, boundary], [-1, -1], [0, -1], [-1, -1]]))
    engine.after_moe(stores[1].layer_id)
    assert engine.stats().bytes_staged - before == row  # the one offloaded local expert routed here
    assert torch.equal(stores[1].w13[boundary], stores[1].host_w13[0])
    engine.close()
    assert HIDDEN  # the fixture's model width, imported with it


def test_c_reload_is_agreed_as_the_slowest_ranks(two_ranks):  # noqa: F811
    rounds, step = two_ranks
    memory = SimpleNamespace(headroom_groups=lambda: 2, tokens_for=lambda groups: 100 * groups,
                             layout=SimpleNamespace(local_experts=64))
    measured = [Coefficients(c_reload_s=0.002, t_prefill_s=3e-4), Coefficients(c_reload_s=0.005, t_prefill_s=1e-4)]
    calibrators = [SimpleNamespace(apply=lambda base, k, e, m=m: m) for m in measured]
    inputs = [PlanInputs(memory, rounds[rank], VampConfig(), SimpleNamespace(guard=None, calibrator=calibrators[rank]),
                         Coefficients(), lambda: step.now, 2) for rank in range(2)]
    agreed = on_both(rounds, lambda rank, r: inputs[rank].coefficients())
    assert [c.c_reload_s for c in agreed] == [pytest.approx(0.005)] * 2  # the slower rank's staging
    assert [c.t_prefill_s for c in agreed] == [pytest.approx(1e-4)] * 2  # the others stay the minimum


def test_a_missed_round_falls_back_to_the_configured_c_reload(two_ranks):  # noqa: F811
    from vamp_sglang.faults import Faults

    rounds, step = two_ranks
    memory = SimpleNamespace(layout=SimpleNamespace(local_experts=64))
    fast = Coefficients(c_reload_s=1e-6)
    inputs = [PlanInputs(memory, rounds[rank], VampConfig(), SimpleNamespace(
        guard=None, calibrator=SimpleNamespace(apply=lambda *a: fast)), Coefficients(), lambda: step.now, 2)
        for rank in range(2)]
    rounds[1].faults = Faults.parse("agree-timeout:1", seed=0)
    agreed = on_both(rounds, lambda rank, r: inputs[rank].coefficients())
    assert {c.c_reload_s for c in agreed} == {Coefficients().c_reload_s}


def launch(*flags: str):
    return prepare(["--device", "cpu", "--model-path", "/nonexistent", "--vamp-max-offload-ratio", "0.2", *flags])


@pytest.mark.parametrize("flags", [["--tp-size", "2", "--ep-size", "2"], ["--tp", "4", "--ep", "2"],
                                   ["--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "none"]])
def test_launcher_serves_expert_parallelism_with_the_standard_dispatcher(flags):
    assert launch(*flags).vamp.enabled


@pytest.mark.parametrize("flags, named", [
    (["--moe-a2a-backend", "deepep"], "--moe-a2a-backend deepep"),
    (["--enable-eplb"], "--enable-eplb"),
    (["--ep-num-redundant-experts", "4"], "--ep-num-redundant-experts 4"),
    (["--pp-size", "2"], "--pp-size"),
])
def test_launcher_still_refuses_what_ep_does_not_lift(flags, named):
    with pytest.raises(ConfigError, match=named):
        launch("--tp-size", "2", "--ep-size", "2", *flags)


def test_a_fused_shared_expert_stays_resident_on_every_ep_rank():
    """SGLang puts a fused shared expert in the last local row of every rank (the dispatcher maps it there:
    token_dispatcher/standard.py:244-253); the offloaded groups end below it."""
    plain = rank_layout(2, 2)
    fused = ExpertLayout.compute(
        moe_layer_ids=list(plain.moe_layer_ids), local_experts=plain.local_experts + 1,
        w13_shard_bytes=plain.w13_shard_bytes, w2_shard_bytes=plain.w2_shard_bytes, granularity_bytes=PAGE,
        max_offload_ratio=0.2, staging_capacity_shards=plain.local_experts + 1, fused_shared_experts=1)
    assert fused.routed_experts == plain.local_experts and fused.bound_groups == plain.bound_groups
    boundary = fused.boundary_expert(fused.bound_groups)
    assert boundary + fused.bound_groups * fused.group_experts == fused.local_experts - 1  # the shared row stays


def test_convert_experts_prices_routed_staging_over_every_ep_rank_s_experts(sglang_moe):  # noqa: F811
    """Issue 45: SGLang's FusedMoE holds E / moe_ep_size local experts; the staging choice's expected routed
    rows must use all E (the router picks among them), so convert_experts hands the engine the layer's EP size."""
    from vamp_sglang.integration.staging import moe_staging
    from vamp_sglang.memory.host_backend import HostPageBackend

    layers = make_layers(sglang_moe[0])
    for layer in layers:
        layer.moe_ep_size = 2  # as an EP2 rank's layer reads it (fused_moe_triton/layer.py:390)
    experts = moe_staging.convert_experts(layers, HostPageBackend("cpu", granularity_bytes=GRAN), RATIO,
                                          staging_policy="auto")
    assert experts.engine.chooser.experts == 2 * experts.stores[0].routed_experts
    experts.close()
