"""Repartitioner with a hybrid model's state pool, on real host pages: groups go to the pool a shortfall is
in, a restore takes the KV pool's groups first and then the state pool's, and a failure at ANY page call
of a state offload or of a restore across both pools changes nothing."""

import pytest
import torch
from test_experts import host_backend, make_layout, make_weights
from test_repartition import (
    EXPERTS,
    HIDDEN,
    INTER,
    LAYERS,
    FaultyBackend,
    InjectedFault,
    PoolSize,
    staged_outputs_exact,
)

from vamp_sglang.memory.kv_buffers import GrowableKVBuffers
from vamp_sglang.memory.layout import LayoutError
from vamp_sglang.memory.repartition import Repartitioner
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_slots import build_expert_stores, close_expert_stores
from vamp_sglang.memory.state_buffers import GrowableStateBuffers, StateKind

# per slot and layer: conv 3 KiB, ssm 16 KiB (the host test granularity is 64 KiB: 4 ssm slots a page)
KINDS = [StateKind((256, 3), torch.float32), StateKind((4, 32, 32), torch.float32)]
STATE_LAYERS, STATE_ROWS = 2, 9


class StateSize:
    """What the state pool glue does with the callback: keep the size, refuse a shrink over used slots."""

    def __init__(self, rows, log):
        self.rows, self.used_rows, self.refuse, self.log = rows, 1, False, log
        self.faulty = False  # every publish but a rollback fails, as under VAMP_SGLANG_FAULT=remap:1

    def resize(self, old_rows, new_rows, rollback=False):
        assert old_rows == self.rows
        if self.faulty and not rollback:
            raise InjectedFault("an injected remap fault")
        if self.refuse or new_rows < self.used_rows:
            self.log.append("state refused")
            raise InjectedFault("state slots in use past the new size")
        self.rows = new_rows


@pytest.fixture
def system():
    real = host_backend()
    backend = FaultyBackend(real)
    weights = make_weights(LAYERS, EXPERTS, HIDDEN, INTER, seed=7)
    layout = make_layout(weights, 0.5)  # bound 4 groups, 9 pages a group
    staging, stores = build_expert_stores(backend, layout, {k: v[:2] for k, v in weights.items() if k})
    kv = GrowableKVBuffers(backend, 3, 2, 16, torch.float32, 512, 16 * 512)
    state = GrowableStateBuffers(backend, KINDS, STATE_LAYERS, STATE_ROWS, 256)
    for k, t in enumerate(state.tensors):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(k)))
    pool, states = PoolSize(kv.row_capacity), StateSize(STATE_ROWS, backend.log)
    engine = StagingEngine(stores, "async")
    rp = Repartitioner(layout, stores, kv, pool.resize, tail_is_free=pool.tail_is_free, staging=engine,
                       state=state, on_state_resize=states.resize)
    yield real, backend, weights, stores, kv, state, pool, states, rp, engine
    engine.close()
    rp.close()
    kv.close()
    state.close()
    close_expert_stores(staging, stores)
    assert real.live_counts().handles == 0
    real.close()


def snapshot(real, stores, kv, state, pool, states, rp):
    stats = rp.stats()
    return {"groups": (stats.offloaded_groups, stats.state_groups, stats.spare_bytes), "rows": (pool.rows, states.rows),
            "kv": kv.checksums(512), "state": state.checksums(states.used_rows),
            "experts": [s.expert_checksums() for s in stores], "live": real.live_counts(),
            "committed": real.committed_bytes}


def test_groups_grow_the_pool_they_are_offloaded_to_and_come_back_kv_first(system):
    real, _backend, weights, stores, kv, state, pool, states, rp, engine = system
    committed, experts = real.committed_bytes, [s.expert_checksums(0, EXPERTS) for s in stores]
    ssm = state.tensors[1]
    # 9 rows: conv 1 page + ssm 3 pages, 2 layers = 8 pages; one group frees 9: the 17 pages hold 24 rows
    # (a layer: conv 2 pages + ssm 6 pages)
    assert rp.state_rows_at(1) == 24 and rp.offload(1, to_state=True) == 15
    assert (states.rows, state.rows, kv.row_capacity, pool.rows) == (24, 24, 512, 512)
    assert state.tensors[1] is ssm and ssm.shape == (2, 24, 4, 32, 32)
    assert rp.stats().spare_bytes == 1 * 64 * 1024
    assert rp.offload(1) == 512 and (rp.kv_groups, rp.state_groups) == (1, 1)
    assert real.committed_bytes == committed  # expert pages became KV and state pages: no new memory
    assert staged_outputs_exact(weights, stores, engine)
    assert rp.restore(1) == 512 and (rp.kv_groups, rp.state_groups, states.rows) == (0, 1, 24)
    assert rp.restore(1) == 0 and (rp.offloaded_groups, states.rows, state.rows) == (0, STATE_ROWS, STATE_ROWS)
    assert [s.expert_checksums(0, EXPERTS) for s in stores] == experts and real.committed_bytes == committed
    with pytest.raises(LayoutError, match="offloaded_groups"):
        rp.offload(5, to_state=True)


def test_a_failure_at_any_step_of_a_state_offload_or_a_mixed_restore_changes_nothing(system):
    real, backend, weights, stores, kv, state, pool, states, rp, engine = system
    rp.offload(1)
    states.used_rows = STATE_ROWS  # every start slot holds a state that must survive
    before = snapshot(real, stores, kv, state, pool, states, rp)
    offload_calls = _calls(backend, lambda: rp.offload(2, to_state=True))
    restore_calls = _calls(backend, lambda: rp.restore(3))  # 1 KV group, then 2 state groups
    rp.offload(1)
    assert snapshot(real, stores, kv, state, pool, states, rp) == before
    for k in range(1, offload_calls + 1):
        backend.arm(k)
        with pytest.raises(InjectedFault):
            rp.offload(2, to_state=True)
        assert snapshot(real, stores, kv, state, pool, states, rp) == before, f"offload failed at call {k}"
    backend.arm(None)
    rp.offload(2, to_state=True)
    after = snapshot(real, stores, kv, state, pool, states, rp)
    for k in range(1, restore_calls + 1):
        backend.arm(k)
        with pytest.raises(InjectedFault):
            rp.restore(3)
        assert snapshot(real, stores, kv, state, pool, states, rp) == after, f"restore failed at call {k}"
    backend.arm(None)
    assert staged_outputs_exact(weights, stores, engine)


def test_a_restore_over_used_state_slots_is_refused_before_any_page_moves(system):
    real, backend, _weights, stores, kv, state, pool, states, rp, _engine = system
    rp.offload(2, to_state=True)
    states.used_rows = states.rows  # a request holds the last slot
    before = snapshot(real, stores, kv, state, pool, states, rp)
    backend.log.clear()
    with pytest.raises(InjectedFault, match="in use"):
        rp.restore(1)
    assert snapshot(real, stores, kv, state, pool, states, rp) == before
    assert "unmap" not in backend.log


def _calls(backend, action):
    backend.arm(None)
    action()
    return backend.calls


def test_undoing_a_state_offload_takes_the_state_pools_groups_back_first(system):
    real, _backend, _weights, stores, kv, state, pool, states, rp, _engine = system
    rp.offload(1)
    before = snapshot(real, stores, kv, state, pool, states, rp)
    rp.offload(1, to_state=True)
    assert rp.restore(1, state_first=True) == 0  # no KV row dropped: the state group came back
    assert snapshot(real, stores, kv, state, pool, states, rp) == before


def test_a_restore_failing_after_its_state_publish_rolls_back_without_a_fault_in_the_rollback(system):
    """The state pool's size is published before its pages go (so a slot in use refuses first); when a later
    step fails, undoing that publish is a rollback, which a fault injector must never make fail too."""
    real, _backend, _weights, stores, kv, state, pool, states, rp, _engine = system
    rp.offload(1, to_state=True)
    rp.offload(1)
    before = snapshot(real, stores, kv, state, pool, states, rp)
    pool.refuse = True  # the KV publish, the restore's last step, fails
    published = []
    publish = states.resize

    def publish_once_then_fault(old_rows, new_rows, rollback=False):
        publish(old_rows, new_rows, rollback)
        published.append(rollback)
        states.faulty = True  # from now on only a rollback may pass

    states.resize = publish_once_then_fault
    rp._on_state_resize = states.resize
    with pytest.raises(InjectedFault, match="refused the new pool size"):
        rp.restore(2)  # 1 KV group, then 1 state group
    assert published == [False, True]
    assert snapshot(real, stores, kv, state, pool, states, rp) == before
