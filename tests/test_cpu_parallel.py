"""CPU mode's hooks for expert parallelism and DP attention (vamp_sglang/cpu/parallel.py), without a server.

- SGLang's native MoE given another rank's -1 ids: the hook's output is the dense reference with the other
  rank's experts removed, and the two ranks' outputs add up to the whole MoE (what the all-reduce forms).
- The gloo all_gatherv stand-in with uneven row counts on a real 2-process gloo group; reduce_scatterv as
  SGLang's all-reduce-and-narrow.
- The launcher's CPU environment counts every pipeline stage's ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
from sglang.srt.layers.moe.token_dispatcher.standard import _map_topk_ids_to_local_experts

from vamp_sglang.cpu import parallel
from vamp_sglang.launch_server import prepare

HIDDEN, INTER, EXPERTS, TOP_K, EP = 16, 12, 8, 3, 2
CONFIG = SimpleNamespace(apply_router_weight_on_input=False, activation="silu", gemm1_alpha=None,
                         gemm1_clamp_limit=None)


def experts_of(w13: torch.Tensor, w2: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(num_experts=w13.shape[0], w13_weight=w13, w2_weight=w2)


def dense_reference(x, w13, w2, weights, ids, owned: range) -> torch.Tensor:
    """Each token's sum over its slots whose expert is in `owned`: w * W2 (silu(gate) * up)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            if e in owned:
                gate, up = F.linear(x[t], w13[e]).chunk(2)
                out[t] += weights[t, slot] * F.linear(F.silu(gate) * up, w2[e])
    return out


@pytest.fixture
def routed():
    g = torch.Generator().manual_seed(0)
    tokens = 23
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 4
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 4
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    ids[0] = torch.tensor([4, 5, 6], dtype=torch.int32)  # a token whose every expert lives on rank 1
    weights = torch.rand(tokens, TOP_K, generator=g)
    return x, w13, w2, weights, ids


def local_view(rank: int, w13, w2, ids):
    """Rank `rank`'s experts and the ids its standard dispatcher hands the MoE (-1: another rank's)."""
    per_rank = EXPERTS // EP
    mapping = torch.full((EXPERTS,), -1, dtype=torch.int32)
    mapping[rank * per_rank:(rank + 1) * per_rank] = torch.arange(per_rank, dtype=torch.int32)
    owned = slice(rank * per_rank, (rank + 1) * per_rank)
    return experts_of(w13[owned].contiguous(), w2[owned].contiguous()), _map_topk_ids_to_local_experts(ids, mapping)


def test_sglangs_native_moe_fails_on_another_ranks_ids(routed):
    x, w13, w2, weights, ids = routed
    layer, local_ids = local_view(0, w13, w2, ids)
    assert bool((local_ids < 0).any())
    with pytest.raises(RuntimeError):
        moe_forward_native(layer, x, (weights, local_ids, None), CONFIG)


@pytest.mark.parametrize("rank", range(EP))
def test_skipping_hook_is_the_dense_reference_without_the_other_ranks_experts(routed, rank):
    x, w13, w2, weights, ids = routed
    layer, local_ids = local_view(rank, w13, w2, ids)
    out = parallel.moe_forward_native_skipping_other_ranks(moe_forward_native, layer, x,
                                                           (weights, local_ids, None), CONFIG)
    per_rank = EXPERTS // EP
    expected = dense_reference(x, w13, w2, weights, ids, range(rank * per_rank, (rank + 1) * per_rank))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if rank == 0:
        assert bool((out[0] == 0).all())  # every expert of token 0 is rank 1's


def test_the_ranks_outputs_add_up_to_the_whole_moe(routed):
    x, w13, w2, weights, ids = routed
    whole = moe_forward_native(experts_of(w13, w2), x, (weights, ids, None), CONFIG)
    parts = [parallel.moe_forward_native_skipping_other_ranks(moe_forward_native, layer, x,
                                                              (weights, local_ids, None), CONFIG)
             for layer, local_ids in (local_view(rank, w13, w2, ids) for rank in range(EP))]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_without_a_minus_one_the_original_runs_unchanged(routed):
    x, w13, w2, weights, ids = routed
    calls = []

    def original(*args):
        calls.append(args)
        return moe_forward_native(*args)

    out = parallel.moe_forward_native_skipping_other_ranks(original, experts_of(w13, w2), x,
                                                           (weights, ids, None), CONFIG)
    assert len(calls) == 1 and calls[0][2][1] is ids
    torch.testing.assert_close(out, moe_forward_native(experts_of(w13, w2), x, (weights, ids, None), CONFIG))


def test_torch_native_answers_the_cpu_fill_value_as_intel_amx():
    assert issubclass(parallel.TorchNativeWithFill, TorchNativeAttnBackend)
    assert not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value")  # why the hook exists
    assert parallel.TorchNativeWithFill.get_cpu_graph_seq_len_fill_value(None) == 1


def test_with_nccl_the_originals_run():
    group = SimpleNamespace(pynccl_comm=SimpleNamespace(available=True))
    assert parallel.all_gatherv(lambda *a: ("orig", a[1:]), group, "x", sizes=[1, 2]) == ("orig", ("x", [1, 2], None))
    assert parallel.reduce_scatterv(lambda *a: ("orig", a[1:]), group, "x", sizes=[1]) == ("orig", ("x", None, [1]))


# ---- a 2-process gloo group on loopback ------------------------------------------------------------------

SIZES = [3, 1]
RANK_MAIN = """
import json, os, sys
from types import SimpleNamespace
import torch, torch.distributed as dist
from vamp_sglang.cpu.gathers import all_gatherv
rank, port, sizes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group = SimpleNamespace(pynccl_comm=SimpleNamespace(available=False), device_group=dist.group.WORLD, world_size=2,
                        rank_in_group=rank)
def never(*args):
    raise AssertionError("the NCCL path ran")
rows = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
ids = torch.full((sizes[rank], 3), rank, dtype=torch.int32)
gathered, gathered_ids = all_gatherv(never, group, [rows, ids], sizes=sizes)
out = torch.empty(sum(sizes), 2)
returned = all_gatherv(never, group, rows, sizes=sizes, output=out)
print(json.dumps([gathered.tolist(), gathered_ids.tolist(), returned[0] is out, out.tolist()]), flush=True)
dist.barrier()  # both ranks are done with the group; then leave without gloo's teardown, which aborted one
os._exit(0)     # rank once ("terminate called without an active exception") when rank 0's store went first
"""


def test_gloo_all_gatherv_with_uneven_sizes():
    """Two fresh interpreters (no SGLang import, no inherited process group) on a loopback gloo group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_MAIN, str(rank), str(port), json.dumps(SIZES)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _out, err in results]
    expected_rows = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [100.0, 101.0]]
    for out, _err in results:
        gathered, ids, in_place, written = json.loads(out.strip().splitlines()[-1])
        assert gathered == expected_rows and written == expected_rows and in_place
        assert ids == [[0] * 3] * 3 + [[1] * 3]


@pytest.mark.parametrize("rank", range(2))
def test_reduce_scatterv_without_nccl_is_sglangs_all_reduce_and_narrow(rank):
    """Uneven sizes through SGLang's own `_deterministic_reduce_scatterv`, on a group whose all-reduce sums two
    ranks holding the same rows."""
    group = SimpleNamespace(pynccl_comm=None, world_size=2, rank_in_group=rank, all_reduce=lambda t: t * 2)
    group._deterministic_reduce_scatterv = partial(GroupCoordinator._deterministic_reduce_scatterv, group)
    full = torch.arange(8.0).reshape(4, 2)
    out = parallel.reduce_scatterv(partial(pytest.fail, "the NCCL path ran"), group, full, sizes=SIZES)
    first = sum(SIZES[:rank])
    assert torch.equal(out, 2 * full[first:first + SIZES[rank]])
    assert torch.equal(full, torch.arange(8.0).reshape(4, 2))  # the input is left as it was


# ---- the launcher's CPU environment ----------------------------------------------------------------------

@pytest.mark.parametrize("flags, ranks", [([], 0), (["--pp-size", "2"], 2), (["--tp-size", "2", "--pp-size", "2"], 4),
                                          (["--tp-size", "2", "--ep-size", "2"], 2)])
def test_launcher_binds_a_core_for_every_rank_of_every_stage(monkeypatch, flags, ranks):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    launch = prepare(["--device", "cpu", "--model-path", "/nonexistent", "--vamp-max-offload-ratio", "0", *flags])
    bind = launch.env.get("SGLANG_CPU_OMP_THREADS_BIND")
    assert (len(bind.split("|")) if bind else 0) == ranks
    assert ("SGLANG_NCCL_SO_PATH" in launch.env) == (ranks > 1)
    assert not os.path.exists(launch.env.get("SGLANG_NCCL_SO_PATH", "/nonexistent"))
