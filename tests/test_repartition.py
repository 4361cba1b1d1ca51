"""Repartitioner transactions on real host pages: pages leave the experts and join the KV tails, the pool
grows through the same tensors, and a failure at ANY step of offload or restore changes nothing."""

import dataclasses

import pytest
import torch
from test_experts import host_backend, make_layout, make_weights

from eval.bench_memory import moe_forward
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers, KVShrinkError
from vamp_sglang.memory.layout import LayoutError
from vamp_sglang.memory.repartition import Repartitioner
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores

LAYERS, EXPERTS, HIDDEN, INTER = [0, 1, 2, 3], 16, 128, 64  # w13 1 page, w2 half a page: g = 2, 3 pages/group


class InjectedFault(RuntimeError):
    pass


class FaultyBackend:
    """A real page backend whose `fail_on_call`-th map/unmap/create (counted from `arm`) raises instead."""

    FAULTY = ("map", "map_run", "unmap", "create")

    def __init__(self, backend):
        self._backend = backend
        self.calls = 0
        self.fail_on_call = None
        self.log = []  # names of the page calls and synchronises, in order

    def synchronize(self):
        self.log.append("synchronize")
        self._backend.synchronize()

    def arm(self, fail_on_call):
        self.calls, self.fail_on_call = 0, fail_on_call

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name not in self.FAULTY:
            return attr

        def call(*args):
            self.calls += 1
            self.log.append(name)
            if self.calls == self.fail_on_call:
                raise InjectedFault(f"{name} call {self.calls} failed")
            return attr(*args)
        return call


class PoolSize:
    """What the allocator glue would do with the callback: remember the size, refuse when told to."""

    def __init__(self, rows):
        self.rows, self.refuse, self.used_rows = rows, False, 0
        self.log = []

    def resize(self, old_rows, new_rows, pool_tokens):
        assert old_rows == self.rows and pool_tokens is None  # these tests publish rows only
        if self.refuse:
            self.log.append("refused")
            raise InjectedFault("a rank refused the new pool size")
        self.rows = new_rows

    def tail_is_free(self, lo, hi):
        return self.used_rows <= lo


@pytest.fixture
def system():
    real = host_backend()
    backend = FaultyBackend(real)
    weights = make_weights(LAYERS, EXPERTS, HIDDEN, INTER, seed=7)
    layout = make_layout(weights, 0.5)  # bound 4 groups
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    kv = GrowableKVBuffers(backend, 3, 2, 16, torch.float32, 512, 16 * 512)  # 6 buffers, 512 rows/page
    for i, t in enumerate(kv.k_buffers + kv.v_buffers):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    pool = PoolSize(kv.row_capacity)
    pool.log = backend.log
    engine = StagingEngine(stores, "async")
    rp = Repartitioner(layout, stores, kv, pool.resize, tail_is_free=pool.tail_is_free, staging=engine)
    yield real, backend, weights, layout, stores, kv, pool, rp, engine
    engine.close()
    rp.close()
    kv.close()
    close_expert_stores(staging, stores)
    assert real.live_counts().handles == 0
    real.close()


def snapshot(real, stores, kv, pool, rp, live_rows):
    stats = dataclasses.replace(rp.stats(), remap_s=0.0, remapped_bytes=0)  # counters of completed remaps
    return {"stats": stats, "pool": pool.rows, "pages": kv.pages_per_buffer,
                "shapes": [tuple(t.shape) for t in kv.k_buffers + kv.v_buffers],
                "kv": kv.checksums(live_rows), "experts": [s.expert_checksums() for s in stores],
                "boundaries": [s.boundary_expert for s in stores], "live": real.live_counts(),
                "committed": real.committed_bytes}


def staged_outputs_exact(weights, stores, engine):
    x = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(9))
    engine.begin_forward()
    for store in stores:
        engine.before_moe(store.layer_id)
        w13, w2, router = weights[store.layer_id]
        if not torch.equal(moe_forward(x, router, store.w13, store.w2, 4), moe_forward(x, router, w13, w2, 4)):
            return False
        engine.after_moe(store.layer_id)
    return True


def test_offload_moves_pages_without_new_memory_and_restore_returns_them(system):
    real, _backend, weights, layout, stores, kv, pool, rp, engine = system
    k0 = kv.k_buffers[0]
    committed = real.committed_bytes
    experts = [s.expert_checksums(0, EXPERTS) for s in stores]
    assert rp.rows_gained(1) == 512  # 9 pages over 6 buffers: 1 page each, 3 spare
    assert rp.offload(1) == 512 and pool.rows == kv.row_capacity == 1024
    assert rp.stats().spare_bytes == 3 * layout.granularity_bytes
    assert rp.rows_gained(1) == 1024  # 3 spare + 9 freed = 12 pages: 2 each
    assert rp.rows_gained(3) == rp.offload(3) == 2560  # 4 groups: 36 pages = 6 each
    assert kv.k_buffers[0] is k0 and k0.shape[0] == 7 * 512 and pool.rows == 3584
    assert real.committed_bytes == committed  # expert pages became KV pages: no new memory
    assert [s.boundary_expert for s in stores] == [8, 8, 8]
    assert staged_outputs_exact(weights, stores, engine)
    assert rp.restore(4) == 3072 and kv.row_capacity == 512 and k0.shape[0] == 512
    assert [s.expert_checksums(0, EXPERTS) for s in stores] == experts
    assert real.committed_bytes == committed
    with pytest.raises(LayoutError, match="offloaded_groups"):
        rp.offload(5)


def test_cycles_keep_every_resident_expert_and_live_kv_row(system):
    _real, _backend, weights, _layout, stores, kv, pool, rp, engine = system
    experts = [s.expert_checksums(0, EXPERTS) for s in stores]
    pool.used_rows = 512  # the fixture wrote every initial row
    for step, (action, n) in enumerate([("o", 2), ("o", 1), ("r", 1), ("o", 2), ("r", 3), ("o", 3), ("r", 4)]):
        if action == "r":  # requests finished: the rows a restore drops are free
            pool.used_rows = min(pool.used_rows, rp.rows_at(rp.offloaded_groups - n))
        live = kv.checksums(pool.used_rows)
        (rp.offload if action == "o" else rp.restore)(n)
        assert kv.checksums(pool.used_rows) == live, f"step {step}: a live KV row changed"
        if action == "o":  # the scheduler fills most of the new rows
            new_used = kv.row_capacity - 100
            for t in kv.k_buffers + kv.v_buffers:
                t[pool.used_rows:new_used].fill_(float(step))
            pool.used_rows = new_used
        for s, ref in zip(stores, experts):
            assert s.expert_checksums() == ref[:s.boundary_expert]
        assert pool.rows == kv.row_capacity == rp.rows_at(rp.offloaded_groups)
        assert staged_outputs_exact(weights, stores, engine)
    assert rp.offloaded_groups == 0 and [s.expert_checksums(0, EXPERTS) for s in stores] == experts


def count_calls(backend, action):
    backend.arm(None)
    action()
    return backend.calls


def test_a_failure_at_any_step_of_offload_or_restore_changes_nothing(system):
    real, backend, weights, _layout, stores, kv, pool, rp, engine = system
    rp.offload(1)  # start with aliases and spare pages in place
    pool.used_rows = kv.row_capacity
    before = snapshot(real, stores, kv, pool, rp, pool.used_rows)
    offload_calls = count_calls(backend, lambda: rp.offload(2))
    restore_calls = count_calls(backend, lambda: rp.restore(2))
    assert snapshot(real, stores, kv, pool, rp, pool.used_rows) == before
    assert offload_calls > 25 and restore_calls > 25  # runs of pages map in one call each
    for k in range(1, offload_calls + 1):
        backend.arm(k)
        with pytest.raises(InjectedFault):
            rp.offload(2)
        assert snapshot(real, stores, kv, pool, rp, pool.used_rows) == before, f"offload failed at call {k}"
    backend.arm(None)
    rp.offload(2)
    after_offload = snapshot(real, stores, kv, pool, rp, pool.used_rows)
    for k in range(1, restore_calls + 1):
        backend.arm(k)
        with pytest.raises(InjectedFault):
            rp.restore(2)
        assert snapshot(real, stores, kv, pool, rp, pool.used_rows) == after_offload, f"restore failed at {k}"
    backend.arm(None)
    assert staged_outputs_exact(weights, stores, engine)
    rp.restore(2)
    assert snapshot(real, stores, kv, pool, rp, pool.used_rows) == before


def test_refusals_change_nothing(system):
    real, _backend, weights, _layout, stores, kv, pool, rp, engine = system
    before = snapshot(real, stores, kv, pool, rp, 512)
    pool.refuse = True  # the allocator (or a rank, through the controller) refuses the new size
    with pytest.raises(InjectedFault, match="refused"):
        rp.offload(2)
    assert snapshot(real, stores, kv, pool, rp, 512) == before
    pool.refuse = False
    rp.offload(2)
    pool.used_rows = kv.row_capacity  # every row in use: nothing may be restored
    mid = snapshot(real, stores, kv, pool, rp, 512)
    with pytest.raises(KVShrinkError):
        rp.restore(1)
    pool.used_rows, pool.refuse = 512, True
    with pytest.raises(InjectedFault, match="refused"):
        rp.restore(1)
    assert snapshot(real, stores, kv, pool, rp, 512) == mid
    assert staged_outputs_exact(weights, stores, engine)


def test_kv_reservation_must_cover_the_bound():
    real = host_backend()
    weights = make_weights(LAYERS, EXPERTS, HIDDEN, INTER)
    layout = make_layout(weights, 0.5)
    staging, stores = build_expert_stores(real, layout, {k: v[:2] for k, v in weights.items() if k})
    kv = GrowableKVBuffers(real, 3, 2, 16, torch.float32, 512, 2048)  # 4 pages; the bound needs 7
    with pytest.raises(LayoutError, match="raise max_rows to 3584"):
        Repartitioner(layout, stores, kv, lambda a, b, c: None, tail_is_free=lambda a, b: True)
    with pytest.raises(LayoutError, match="eligible layers"):
        Repartitioner(layout, stores[1:], kv, lambda a, b, c: None, tail_is_free=lambda a, b: True)
    kv.close()
    kv = GrowableKVBuffers.for_layout(real, layout, 3, 2, 16, torch.float32, 512)  # sized for the bound
    rp = Repartitioner(layout, stores, kv, lambda a, b, c: None, tail_is_free=lambda a, b: True)
    rp.offload(layout.bound_groups)
    assert kv.pages_per_buffer == kv.max_pages_per_buffer == 7
    rp.restore(layout.bound_groups)
    rp.close()
    kv.close()
    for store in stores:
        store.close()
    staging.close()
    real.close()


def test_a_rollback_synchronises_before_it_unmaps(system):
    """Issue 10 item 2: the last step may fail while a zero-fill of the new KV rows is still queued on
    the device; the rollback must synchronise before it unmaps any page."""
    _real, backend, _weights, _layout, _stores, _kv, pool, rp, _engine = system
    pool.refuse = True
    for remap in (lambda: rp.offload(2), lambda: (setattr(pool, "refuse", False), rp.offload(2),
                                                  setattr(pool, "refuse", True), rp.restore(2))):
        backend.log.clear()
        with pytest.raises(InjectedFault, match="refused"):
            remap()
        rollback = backend.log[backend.log.index("refused") + 1:]
        assert rollback[0] == "synchronize" and "unmap" in rollback


def test_one_synchronise_per_transaction(system):
    """Issue 10 item 8: the stores and KV buffers inside a transaction do not synchronise again, and map
    contiguous runs."""
    _real, backend, _weights, _layout, stores, kv, _pool, rp, _engine = system
    for remap, runs in ((lambda: rp.offload(3), 2 * len(stores) + kv.n_buffers), (lambda: rp.restore(2), 2 * len(stores))):
        backend.log.clear()
        remap()
        assert backend.log.count("synchronize") == 1 and backend.log[0] == "synchronize"
        # pages move as contiguous runs (access set once per run): w13 and w2 of each store, each K/V buffer
        assert "map" not in backend.log and backend.log.count("map_run") == runs
    assert rp.stats().remapped_bytes == 5 * rp.layout.bytes_freed_per_group
    assert rp.stats().remap_s > 0 and rp.stats().remap_gib_per_s > 0
