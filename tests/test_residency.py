"""Residency by routing (issue 49): decayed routing counts, the logical -> physical map applied to top-k ids,
and the row swaps inside an offload transaction on real host pages: the offloaded rows hold the coldest
experts, MoE outputs are bit-identical to the unpermuted layer, and a rollback restores rows, host copies,
resident per-expert tensors and the map together; a rank undoes a refused round without a collective, and
the counts are summed over one round group only (`routing_group`, the one test that reads SGLang's groups)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_experts import host_backend, make_layout, make_weights
from test_integration_memory import GRAN, RATIO, make_layers, sglang_moe  # noqa: F401 (sglang_moe: fixture)
from test_repartition import HIDDEN as REPART_HIDDEN
from test_repartition import (
    InjectedFault,
    count_calls,
    snapshot,
    system,  # noqa: F401 (the fixture)
)

from vamp_sglang.memory.journal import Journal, atomic
from vamp_sglang.memory.residency import (
    ExpertOrder,
    ExpertRows,
    Residency,
    RoutingCounts,
    plan_swaps,
    reorder_rows,
)
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores

ROOT = Path(__file__).resolve().parents[1]
EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 24, 128, 64, 2, 32  # w13 64 KiB, w2 32 KiB: a group is 2 experts


def moe_with_ids(x, gates, ids, w13, w2):
    """SiLU-gated experts at the given rows, one top-k slot at a time over per-token gathered weights."""
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        gate, up = torch.bmm(w13[ids[:, k]], x[:, :, None])[..., 0].chunk(2, dim=-1)
        out += gates[:, k, None] * torch.bmm(w2[ids[:, k]], (F.silu(gate) * up)[:, :, None])[..., 0]
    return out


def skewed_routes(router, x):
    gates, ids = torch.topk(torch.softmax(x @ router.T, dim=-1), TOP_K, dim=-1)
    return gates / gates.sum(dim=-1, keepdim=True), ids


def test_plan_puts_the_coldest_experts_in_the_offloaded_rows():
    counts = [5.0, 1.0, 9.0, 0.0, 7.0, 2.0]  # logical expert -> count
    logical_at = [0, 1, 2, 3, 4, 5]
    pairs = plan_swaps(counts, logical_at, boundary=3)  # rows 3..5 hold 3 (0), 4 (7), 5 (2)
    assert pairs == [(1, 4)]  # hottest offloaded (4: 7) <-> coldest resident (1: 1); 5 (2) < 5 (5) stays
    for a, b in pairs:
        logical_at[a], logical_at[b] = logical_at[b], logical_at[a]
    assert sorted(logical_at[3:]) == [1, 3, 5]  # the three coldest
    assert plan_swaps(counts, logical_at, 3) == []  # stable once ordered
    assert plan_swaps([1.0] * 6, list(range(6)), 3) == []  # ties never move rows


def test_counts_decay_ignore_padding_and_sum_over_layers_separately():
    counts = RoutingCounts(layers=2, experts=4, halflife_steps=1.0)
    counts.observe(0, torch.tensor([[0, 1], [0, -1]]))
    counts.observe(0, torch.tensor([[2, 4]]))  # 4 is not a routed id: the sentinel takes it
    assert counts.agreed().tolist() == [[1.0, 0.5, 1.0, 0.0], [0.0] * 4]  # the first step halved once
    storage = counts._counts.data_ptr()
    counts.reset()  # in place: a captured graph keeps counting into the same tensor
    assert counts.agreed().tolist() == [[0.0] * 4] * 2 and counts._counts.data_ptr() == storage
    with pytest.raises(ValueError, match="halflife_steps"):
        RoutingCounts(1, 4, halflife_steps=0)


def test_map_rewrites_routed_ids_and_leaves_padding_and_shared_experts():
    order = ExpertOrder(layers=2, routed=4)
    order.swap(1, 0, 3)
    ids = torch.tensor([[0, 3], [-1, 4], [1, 2]], dtype=torch.int32)
    order.map_ids(1, ids)
    assert ids.tolist() == [[3, 0], [-1, 4], [1, 2]] and ids.dtype == torch.int32
    untouched = torch.tensor([[0, 3]])
    order.map_ids(0, untouched)
    assert untouched.tolist() == [[0, 3]] and order.physical_of(1) == [3, 1, 2, 0]


def test_the_order_digest_follows_every_layers_rows_and_survives_a_float_gauge():
    orders = [ExpertOrder(layers=2, routed=4) for _ in range(3)]
    orders[1].swap(1, 0, 3)
    orders[2].swap(0, 0, 3)  # the same swap on the other layer
    digests = [order.digest() for order in orders]
    assert len(set(digests)) == 3 and all(0 <= d < 2**48 and float(d) == d for d in digests)
    orders[1].swap(1, 0, 3)  # swapped back: the identity's digest again
    assert orders[1].digest() == digests[0] == ExpertOrder(layers=2, routed=4).digest()


@pytest.fixture
def layer():
    backend = host_backend()
    weights = make_weights([0, 1], EXPERTS, HIDDEN, INTER, seed=3)
    router = weights[1][2].clone()
    router[EXPERTS // 2:] *= 4  # wide logits: the high-index experts, which residency by index offloads, are
    router[: EXPERTS // 2] *= 0.1  # the hot ones
    layout = make_layout(weights, 0.5)
    staging, stores = build_expert_stores(backend, layout, {1: weights[1][:2]})
    yield backend, weights, router, layout, stores[0]
    stores[0].close()
    staging.close()
    backend.close()


def _offload_by_routing(store, order, counts, groups, scales, journal):
    """The transaction: swap rows while they are resident, then let the pages go."""
    rows = ExpertRows([store.w13, store.w2], [store.host_w13, store.host_w2], store.routed_experts, [scales])
    target = store.layout.boundary_expert(store.offloaded_groups + groups)
    moved, _pairs = reorder_rows(order, 0, rows, counts, store.boundary_expert, target, journal)
    return moved, store.offload_tail_pages(groups, journal)


def test_offloaded_rows_hold_the_coldest_and_outputs_are_unchanged(layer):
    backend, weights, router, layout, store = layer
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    gates, logical = skewed_routes(router, x)
    w13, w2 = weights[1][:2]
    reference = moe_with_ids(x, gates, logical, w13, w2)
    counts = RoutingCounts(1, EXPERTS)
    counts.observe(0, logical)
    order = ExpertOrder(1, EXPERTS)
    scales = torch.arange(EXPERTS, dtype=torch.float32)[:, None].repeat(1, 3)  # a resident per-expert tensor
    groups = layout.groups_for_ratio(0.5)
    with atomic(None) as journal:
        moved, freed = _offload_by_routing(store, order, counts.agreed()[0], groups, scales, journal)
    for handle in freed:
        backend.release(handle)
    boundary = store.boundary_expert
    assert boundary == EXPERTS // 2 and moved > 0
    by_count = counts.agreed()[0]
    offloaded = order.logical_at[0][boundary:]
    coldest = sorted(range(EXPERTS), key=lambda e: (by_count[e].item(), e))[:EXPERTS - boundary]
    assert sorted(by_count[offloaded].tolist()) == sorted(by_count[coldest].tolist())
    assert scales[:, 0].tolist() == [float(e) for e in order.logical_at[0]]  # scales moved with their rows
    physical = logical.clone()
    order.map_ids(0, physical)
    engine = StagingEngine([store], "sync")
    engine.begin_forward()
    engine.before_moe(1)  # whole staging of the offloaded rows from the (swapped) host copies
    assert torch.equal(moe_with_ids(x, gates, physical, store.w13, store.w2), reference)
    rows = order.logical_at[0]  # every physical row, staged or resident, holds its logical expert's weights
    assert torch.equal(store.w13, w13[rows]) and torch.equal(store.w2, w2[rows])
    engine.after_moe(1)
    engine.close()
    staged_by_index = (logical >= boundary).sum().item()
    assert (physical >= boundary).sum().item() < staged_by_index / 2  # far fewer picks reach the staged rows


def test_a_failed_transaction_restores_rows_host_copies_scales_and_map(layer):
    _backend, _weights, router, layout, store = layer
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))
    counts = RoutingCounts(1, EXPERTS)
    counts.observe(0, skewed_routes(router, x)[1])
    order = ExpertOrder(1, EXPERTS)
    scales = torch.randn(EXPERTS, 3)
    before = (store.w13.clone(), store.w2.clone(), store.host_w13.clone(), store.host_w2.clone(), scales.clone())
    journal = Journal()
    moved, freed = _offload_by_routing(store, order, counts.agreed()[0], layout.groups_for_ratio(0.5), scales,
                                       journal)
    assert moved > 0 and freed and order.logical_at[0] != list(range(EXPERTS))
    journal.rollback()  # as the KV side's failure would: pages back, then the swaps undone, newest first
    after = (store.w13, store.w2, store.host_w13, store.host_w2, scales)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert order.logical_at[0] == list(range(EXPERTS))
    assert order.device_map[0].tolist() == list(range(EXPERTS)) and store.offloaded_groups == 0



def _route(residency, stores, weights, sharpness, tokens):
    """Each layer's own skew: its router's picks on random tokens (a negative sharpness reverses it)."""
    for index, store in enumerate(stores):
        x = torch.randn(tokens, REPART_HIDDEN, generator=torch.Generator().manual_seed(index))
        residency.route(index, skewed_routes(weights[store.layer_id][2] * sharpness, x)[1])


def _state(real, stores, kv, pool, rp):
    """Everything a transaction may touch: pages, sizes, resident rows, host copies, the map."""
    return (snapshot(real, stores, kv, pool, rp, pool.used_rows), [list(a) for a in rp.residency.order.logical_at],
            [torch.cat([s.host_w13.flatten(), s.host_w2.flatten()]) for s in stores])


def _same(a, b):
    return a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_repartition_transactions_reorder_rows_and_roll_back_whole(system):  # noqa: F811
    """Through the Repartitioner: a failure at any page call of an offload or a restore leaves pages, rows,
    host copies and map as they were; a completed offload holds each layer's coldest experts and staged
    outputs through the mapped ids equal the original layer's."""
    real, backend, weights, _layout, stores, kv, pool, rp, engine = system
    rows = [ExpertRows([s.w13, s.w2], [s.host_w13, s.host_w2], s.routed_experts) for s in stores]
    rp.residency = residency = Residency(rows)
    _route(residency, stores, weights, 3.0, 64)
    calls = count_calls(backend, lambda: rp.offload(2))  # a first cycle reorders rows at the offload
    rp.restore(2)
    swaps = residency.swaps
    _route(residency, stores, weights, -3.0, 1024)  # the other experts are hot now: the next offload swaps
    before, figures = _state(real, stores, kv, pool, rp), residency.stats()
    for k in range(1, calls + 1):
        backend.arm(k)
        with pytest.raises(InjectedFault):
            rp.offload(2)
        assert _same(_state(real, stores, kv, pool, rp), before), f"offload failed at page call {k}"
    backend.arm(None)
    publish = rp._on_pool_resize

    def write_then_refuse(old_rows, new_rows, pool_tokens):  # the lent pages hold KV bytes at the rollback
        for buffer in kv.k_buffers + kv.v_buffers:
            buffer[old_rows:new_rows].fill_(7.0)
        raise InjectedFault("a rank refused the new pool size")

    rp._on_pool_resize = write_then_refuse
    with pytest.raises(InjectedFault):
        rp.offload(2)
    assert _same(_state(real, stores, kv, pool, rp), before)
    assert residency.stats() == figures  # the figures are journalled too
    rp._on_pool_resize = publish
    rp.offload(2)
    assert residency.swaps > swaps > 0 and residency.coldest
    assert residency.offloaded_share < residency.offloaded_share_by_index
    x = torch.randn(16, REPART_HIDDEN, generator=torch.Generator().manual_seed(11))
    engine.begin_forward()
    for index, store in enumerate(stores):
        engine.before_moe(store.layer_id)
        w13, w2, router = weights[store.layer_id]
        gates, logical = skewed_routes(router * 3, x)
        physical = logical.clone()
        residency.route(index, physical)
        assert torch.equal(moe_with_ids(x, gates, physical, store.w13, store.w2),
                           moe_with_ids(x, gates, logical, w13, w2))
        engine.after_moe(store.layer_id)
    after_offload, k = _state(real, stores, kv, pool, rp), 1
    while True:  # fail the restore at page call 1, 2, ... until it has fewer calls than k
        backend.arm(k)
        try:
            rp.restore(2)
        except InjectedFault:
            assert _same(_state(real, stores, kv, pool, rp), after_offload), f"restore failed at page call {k}"
            k += 1
            continue
        break
    backend.arm(None)
    assert k > 10 and rp.offloaded_groups == 0


AGREE_MAIN = """
import json, os, sys
import torch, torch.distributed as dist
from vamp_sglang.memory.residency import ExpertOrder, ExpertRows, Residency, plan_swaps
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
rows = [ExpertRows([torch.zeros(8, 1)], [torch.zeros(4, 1)], 8)]
residency = Residency(rows, group=dist.group.WORLD)
residency.route(0, torch.tensor([[7, 6]] * 3 if rank else [[0, 1], [0, 7]]))  # counts that differ
counts = residency.agree()
print(json.dumps([counts.tolist(), plan_swaps(counts[0].tolist(), list(range(8)), 4)]), flush=True)
dist.barrier()  # both ranks are done with the group; leave without gloo's teardown, which aborted a rank
os._exit(0)     # ("terminate called without an active exception", rc -6) in make test, as in test_cpu_parallel
"""


def test_ranks_agree_on_summed_counts_and_so_on_the_swaps():
    """Two fresh interpreters on a loopback gloo group, as two ranks of one round group (the TP ranks, or one
    DP rank's attention-TP ranks: `routing_group`), whose counts differ however they came to: both plan from
    the sum of their counts, so both offload the same experts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", AGREE_MAIN, str(r), str(port)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | {"OMP_NUM_THREADS": "1"})
             for r in range(2)]
    answers = [(p.communicate(timeout=120), p.returncode) for p in ranks]
    assert [code for _, code in answers] == [0, 0], [err[-2000:] for (_, err), _ in answers]
    (counts, pairs), other = (json.loads(out.strip().splitlines()[-1]) for (out, _), _ in answers)
    assert [counts, pairs] == other
    assert counts == [[2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0, 4.0]]
    assert pairs == [[2, 7], [3, 6]]  # rows 7 and 6 (counts 4, 3) trade with the unrouted resident rows 2, 3


UNDO_MAIN = """
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from test_repartition import InjectedFault, system
from test_residency import _route
from vamp_sglang.memory.residency import ExpertRows, Residency
rank, port, done = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
real, backend, weights, _layout, stores, kv, pool, rp, engine = next(system.__wrapped__())
rows = [ExpertRows([s.w13, s.w2], [s.host_w13, s.host_w2], s.routed_experts) for s in stores]
rp.residency = residency = Residency(rows, group=dist.group.WORLD)
_route(residency, stores, weights, 3.0, 64 if rank else 32)
rp.offload(2)  # a first round both ranks commit
_route(residency, stores, weights, -3.0, 4096)  # other experts hot now: the next restore swaps rows
before = ([list(at) for at in residency.order.logical_at], [s.expert_checksums() for s in stores])
if rank:  # rank 1 refuses the round after the counts were summed
    rp._on_pool_resize = lambda *_: (_ for _ in ()).throw(InjectedFault("rank 1 refuses"))
try:
    rp.restore(1)
except InjectedFault:
    for _ in range(600):  # no collective: rank 0 must undo on its own
        if os.path.exists(done):
            break
        time.sleep(0.05)
else:
    try:
        start, swaps = time.perf_counter(), residency.swaps
        with rp.undoing():  # what ExpertMemory.return_to runs: the round's transaction undone
            rp.offload(1)
        after = ([list(at) for at in residency.order.logical_at], [s.expert_checksums() for s in stores])
        print(json.dumps([after == before, residency.order.logical_at != [list(range(len(before[0][0])))] * 2,
                          swaps, residency.swaps, time.perf_counter() - start]))
    finally:
        open(done, "w").close()
sys.stdout.flush()
os._exit(0)  # without gloo's teardown (see AGREE_MAIN)
"""


def test_a_rank_undoes_a_refused_round_without_a_collective(tmp_path):
    """Two ranks commit an offload, then rank 1 refuses a restore after both summed their counts: rank 0,
    which applied it, undoes it alone (ExpertMemory.return_to's transactions) without entering the counts'
    collective, which rank 1 never enters again, and ends with the rows and map it had before the round."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", UNDO_MAIN, str(r), str(port), str(tmp_path / "done")],
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT}/tests"})
             for r in range(2)]
    answers = [(p.communicate(timeout=90), p.returncode) for p in ranks]
    assert [code for _, code in answers] == [0, 0], [err[-2000:] for (_, err), _ in answers]
    rank0 = answers[0][0][0].strip().splitlines()[-1]
    same, permuted, swaps_applied, swaps_after, seconds = json.loads(rank0)
    assert same and permuted and seconds < 5  # swaps replayed inverted, no wait on the 30 s timeout
    assert swaps_applied > swaps_after  # the undone round's swaps no longer counted


@pytest.mark.parametrize("dp_attention, attn_tp, summed_over", [(False, 4, "tp"), (True, 2, "attn_tp"),
                                                                 (True, 1, None)])
def test_counts_are_summed_over_one_round_group_only(monkeypatch, dp_attention, attn_tp, summed_over):
    """Under DP attention each DP rank offloads in its own round (controller/groups.py) while the other DP
    ranks sit in SGLang's per-step MLP-sync collectives on the TP group: the counts' collective must span
    only ranks of one round, the rank's attention-TP group (none at attention-TP 1). Plain TP: the TP
    group; expert parallelism: no group (each rank orders its own experts)."""
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state

    from vamp_sglang.integration.staging.expert_order import routing_group

    parallel = SimpleNamespace(attn_dp_enabled=dp_attention, tp_size=4, attn_tp_size=attn_tp, attn_cp_size=1,
                               tp_group=SimpleNamespace(world_size=4, cpu_group="tp"),
                               attn_tp_group=SimpleNamespace(world_size=attn_tp, cpu_group="attn_tp"))
    for module in (runtime_context, parallel_state):
        monkeypatch.setattr(module, "get_parallel", lambda: parallel)
    assert routing_group(SimpleNamespace(moe_ep_size=1)) == summed_over
    assert routing_group(SimpleNamespace(moe_ep_size=2)) is None


def _plain_scales(layer):
    layer.hpc_ops_w13_weight_scale = torch.ones(layer.w13_weight.shape[0], 2)  # as fp8.py's hpc_ops set-up


def _hpc_ops_runner(layer):
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    layer.quant_method.runner = SimpleNamespace(runner_backend=MoeRunnerBackend.HPC_OPS)


@pytest.mark.parametrize("change, refusal", [(None, None), (_hpc_ops_runner, "runs the hpc_ops MoE runner"),
                                             (_plain_scales, "hpc_ops_w13_weight_scale")])
def test_routing_order_is_refused_where_a_swap_would_leave_per_expert_state_behind(
        sglang_moe, change, refusal):  # noqa: F811
    """A swap moves w13/w2, their host copies and the layer's per-expert Parameters. Runners other than
    SGLang's Triton MoE (the CPU path runs it too) keep derived per-expert copies elsewhere, e.g. hpc_ops
    FP8's padded scales as plain attributes: refused at conversion, naming the flag, not served wrong."""
    from vamp_sglang.integration.staging import moe_staging
    from vamp_sglang.memory.host_backend import HostPageBackend

    layers = make_layers(sglang_moe[0])
    for layer in layers if change else ():
        change(layer)
    backend = HostPageBackend("cpu", granularity_bytes=GRAN)
    if refusal is None:
        experts = moe_staging.convert_experts(layers, backend, RATIO, expert_order="routing")
        assert experts.residency is not None and experts.residency.group is None  # one rank
        experts.close()
        return
    with pytest.raises(moe_staging.ExpertConversionError, match=f"--vamp-expert-order routing.*{refusal}"):
        moe_staging.convert_experts(layers, backend, RATIO, expert_order="routing")
    backend.close()


@pytest.mark.parametrize("backend", ["hpc_ops", "flashinfer_cutlass"])
def test_the_launcher_refuses_routing_order_on_other_moe_runners_naming_both_flags(backend):
    from vamp_sglang.config import ConfigError
    from vamp_sglang.launch_server import prepare

    argv = ["--device", "cpu", "--model-path", "/nonexistent", "--vamp-max-offload-ratio", "0.2",
            "--vamp-expert-order", "routing", "--moe-runner-backend"]
    with pytest.raises(ConfigError, match=f"--vamp-expert-order routing .*--moe-runner-backend {backend}"):
        prepare([*argv, backend])
    assert prepare([*argv, "triton"]).vamp.expert_order == "routing"
