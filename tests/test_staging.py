"""Double-buffered staging: MoE outputs over remapped + staged experts are bit-identical to the originals
at 0%, 10%, 25% and the maximum offload (paper IV-D, V-B), and staging is what makes them so."""

import threading
import time

import pytest
import torch
from test_experts import host_backend, make_layout, make_weights

from eval.bench_memory import moe_forward
from vamp_sglang.memory.backend import HostArena
from vamp_sglang.memory.experts import host_copy_bytes
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import StagingBuffers, build_expert_stores

LAYERS, EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = [0, 1, 2, 3], 40, 128, 128, 4, 64  # g = 1


@pytest.fixture
def model():
    backend = host_backend()
    weights = make_weights(LAYERS, EXPERTS, HIDDEN, INTER, seed=1)
    layout = make_layout(weights, 0.5)
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    yield backend, weights, layout, stores
    for store in stores:
        store.close()
    staging.close()
    backend.close()


def forward(x, weights, stores, engine=None, used=None):
    """Residual stack of MoE layers over the stores' tensors; layers without a store (the first MoE
    layer, or all of them for the reference) read the original weights."""
    tensors = {lid: w[:2] for lid, w in weights.items()} | {s.layer_id: (s.w13, s.w2) for s in stores}
    if engine is not None:
        engine.begin_forward()
    for lid in LAYERS:
        if engine is not None:
            engine.before_moe(lid)
        if used is not None:
            used[lid] = set(torch.topk(x @ weights[lid][2].T, TOP_K).indices.flatten().tolist())
        x = x + moe_forward(x, weights[lid][2], *tensors[lid], TOP_K)
        if engine is not None:
            engine.after_moe(lid)
    return x


def offload(stores, groups):
    for store in stores:
        for handle in store.offload_tail_pages(groups):
            store.backend.release(handle)


@pytest.mark.parametrize("ratio", [0.0, 0.10, 0.25, "max"])
def test_moe_output_is_bit_identical_at_every_offload_level(model, ratio):
    _backend, weights, layout, stores = model
    groups = layout.bound_groups if ratio == "max" else layout.groups_for_ratio(ratio)
    assert groups == {0.0: 0, 0.10: 4, 0.25: 10, "max": 20}[ratio]
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    reference = forward(x, weights, [])  # original tensors only
    offload(stores, groups)
    engine = StagingEngine(stores, "async")
    used: dict[int, set[int]] = {}
    for _ in range(2):  # the second forward reuses slots the first one filled
        assert torch.equal(forward(x, weights, stores, engine, used), reference)
    boundary = layout.boundary_expert(groups)
    if groups:  # the batch really read staged experts in every eligible layer
        assert all(any(e >= boundary for e in used[lid]) for lid in layout.eligible_layer_ids)
        assert engine.stats().copies == 2 * len(stores)
    engine.close()


def test_without_staging_the_offloaded_range_reads_stale_slot_data(model):
    _backend, weights, layout, stores = model
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    reference = forward(x, weights, stores)
    offload(stores, layout.groups_for_ratio(0.25))
    engine = StagingEngine(stores, "async")
    assert torch.equal(forward(x, weights, stores, engine), reference)
    # Layers 1 and 3 share slot 0, so after a forward layer 1's offloaded experts read layer 3's bytes.
    assert not torch.equal(forward(x, weights, stores), reference)
    engine.close()


def test_sync_mode_matches_and_counters_add_up(model):
    _backend, weights, layout, stores = model
    groups = layout.groups_for_ratio(0.25)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    reference = forward(x, weights, stores)
    offload(stores, groups)
    sync = StagingEngine(stores, "sync")
    assert torch.equal(forward(x, weights, stores, sync), reference)
    per_layer_bytes = groups * (layout.w13_group_pages + layout.w2_group_pages) * layout.granularity_bytes
    stats = sync.stats()
    assert (stats.copies, stats.bytes_staged, stats.unprefetched) == (3, 3 * per_layer_bytes, 0)
    sync.close()
    lazy = StagingEngine(stores, "async")  # no begin_forward: the first MoE layer starts the first copy
    for lid in LAYERS:
        lazy.before_moe(lid)
    assert (lazy.stats().unprefetched, lazy.stats().copies) == (0, 3)
    lazy.before_moe(1)  # a layer nobody prefetched for copies on demand
    assert lazy.stats().unprefetched == 1
    assert lazy._executor.submit(torch.get_num_threads).result() == 1  # one intra-op thread in the worker
    lazy.close()


def test_drain_discards_prefetch_for_an_old_boundary(model):
    _backend, weights, _layout, stores = model
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))
    reference = forward(x, weights, stores)
    offload(stores, 2)
    engine = StagingEngine(stores, "async")
    engine.begin_forward()  # a prefetch for 2 groups is in flight
    engine.drain()
    offload(stores, 6)  # the boundary moves before the forward runs
    assert torch.equal(forward(x, weights, stores, engine), reference)
    engine.close()


def test_next_layers_copy_is_issued_before_the_current_moe_runs(model):
    """Figure 5: while layer N's MoE runs, layer N+1's copy is already in flight (into the other slot)."""
    _backend, _weights, _layout, stores = model
    offload(stores, 4)
    engine = StagingEngine(stores, "async")
    engine.begin_forward()
    assert engine.stats().copies == 1  # layer 1, before the resident first MoE layer runs
    issued = []
    for lid in LAYERS:
        engine.before_moe(lid)
        issued.append(engine.stats().copies)
        engine.after_moe(lid)
    assert issued == [1, 2, 3, 3]  # at layer 1's MoE, layer 2's copy exists; at layer 2's, layer 3's
    engine.close()


# ---- issue 10: capture, host arena, measured times, split w13/w2 waits --------------------------------

def test_hooks_do_nothing_while_a_stream_is_capturing(model):
    """Item 1: during a graph capture the hooks must not record or wait on events (they would be graph
    nodes); the capture check is injected so the same logic runs here."""
    _backend, weights, _layout, stores = model
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(6))
    reference = forward(x, weights, [])
    offload(stores, 4)
    capturing = [True]
    engine = StagingEngine(stores, "async", is_capturing=lambda: capturing[0])
    forward(x, weights, stores, engine)  # a "capture": every hook returns at once
    stats = engine.stats()
    assert (stats.copies, stats.steps, stats.unprefetched, stats.timed_copies) == (0, 0, 0, 0)
    assert not engine._pending and not engine._timing
    capturing[0] = False
    assert torch.equal(forward(x, weights, stores, engine), reference)
    assert engine.stats().copies == len(stores) and engine.stats().steps == 1
    engine.close()


def test_one_host_arena_holds_every_layers_host_copy_exactly(model):
    """Item 3: no per-buffer (power-of-two rounded) pinned allocations; one arena of the exact size."""
    backend, weights, layout, stores = model
    arena_ptrs = {t.untyped_storage().data_ptr() for s in stores for t in (s.host_w13, s.host_w2)}
    assert len(arena_ptrs) == 1
    expected = len(stores) * HostArena.bytes_for(
        [layout.offloadable_experts * layout.w13_shard_bytes, layout.offloadable_experts * layout.w2_shard_bytes])
    assert host_copy_bytes(layout) == expected
    staging = StagingBuffers(backend, layout)
    assert staging.host_arena.nbytes == expected and staging.pinned_bytes == 0  # host pages: nothing locked
    staging.close()
    for s in stores:
        w13, w2, _ = weights[s.layer_id]
        assert torch.equal(s.host_w13, w13[EXPERTS - layout.offloadable_experts:])
        assert torch.equal(s.host_w2, w2[EXPERTS - layout.offloadable_experts:])


class SlowCopyEngine(StagingEngine):
    """Real copies, each started `delay_s` late on the worker, so the MoE side must wait for them."""

    delay_s = 0.05

    def _copy_host(self, copy, pairs):
        time.sleep(self.delay_s)
        super()._copy_host(copy, pairs)


def test_copy_and_wait_times_are_measured_per_step(model):
    """Item 5: stalls and wait_s come from when the copy really finished, not from a query at enqueue."""
    _backend, weights, _layout, stores = model
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    reference = forward(x, weights, [])
    offload(stores, 10)
    engine = SlowCopyEngine(stores, "async")
    for _ in range(2):
        assert torch.equal(forward(x, weights, stores, engine), reference)
    stats = engine.stats()
    assert stats.steps == 2 and stats.copies == stats.timed_copies == 2 * len(stores)
    assert stats.copy_s > 0 and stats.step_copy_s > 0 and stats.step_copy_s < stats.copy_s
    assert stats.stalls >= 2  # at least the first copy of each step started late
    assert stats.wait_s >= 0.03 and 0 < stats.step_wait_s <= stats.wait_s
    engine.close()
    fast = StagingEngine(stores, "sync")  # inline copies never make the MoE wait
    forward(x, weights, stores, fast)
    assert fast.stats().stalls == 0 and fast.stats().wait_s == 0 and fast.stats().copy_s > 0
    fast.close()


class _GatedCopy:
    """A copy destination whose copy waits for a gate (the w2 copy is still in flight)."""

    def __init__(self, dst, gate):
        self.dst, self.gate = dst, gate

    def copy_(self, src):
        assert self.gate.wait(10)
        self.dst.copy_(src)


class GatedW2Engine(StagingEngine):
    def __init__(self, *args, gate, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = gate

    def _copy_host(self, copy, pairs):
        (w13_dst, w13_src), (w2_dst, w2_src) = pairs
        super()._copy_host(copy, [(w13_dst, w13_src), (_GatedCopy(w2_dst, self.gate), w2_src)])


def test_split_wait_lets_the_gate_up_gemm_start_before_w2_is_staged(model):
    """Item 6: with split waits, before_moe returns once w13 is staged; w2 is awaited before the down
    projection (paper V-B)."""
    _backend, weights, layout, stores = model
    offload(stores, 4)
    gate = threading.Event()
    engine = GatedW2Engine(stores, "async", split_w2_wait=True, gate=gate)
    first = stores[0]
    boundary = layout.boundary_expert(4)
    engine.begin_forward()
    engine.before_moe(first.layer_id)  # returns although the w2 copy is blocked
    assert torch.equal(first.w13[boundary:], weights[first.layer_id][0][boundary:])
    assert not engine._w2_pending[0].w2_done.done()
    gate.set()
    engine.before_down_proj(first.layer_id)
    assert torch.equal(first.w2[boundary:], weights[first.layer_id][1][boundary:])
    engine.after_moe(first.layer_id)
    engine.close()


def test_a_down_gemm_that_skipped_its_w2_wait_turns_split_waits_off(model):
    """If a layer's MoE finished without `before_down_proj` (a kernel path our hook does not see), its w2
    was read unwaited: the engine counts it and waits for w13 and w2 together from then on."""
    _backend, weights, layout, stores = model
    offload(stores, 4)
    engine = StagingEngine(stores, "async", split_w2_wait=True)
    engine.begin_forward()
    engine.before_moe(stores[0].layer_id)
    engine.after_moe(stores[0].layer_id)
    assert engine.missed_w2_waits == 1 and not engine.split_w2_wait
    engine.before_moe(stores[1].layer_id)
    assert not engine._w2_pending  # joint wait: w2 is staged when before_moe returns
    boundary = layout.boundary_expert(4)
    assert torch.equal(stores[1].w2[boundary:], weights[stores[1].layer_id][1][boundary:])
    engine.after_moe(stores[1].layer_id)
    assert engine.missed_w2_waits == 1
    engine.close()
