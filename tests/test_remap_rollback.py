"""A remap that fails or is refused leaves memory and the model as before (issue 19 items 2, 4 and 10), on
the same real SGLang pool, allocator and paged FusedMoE layers as tests/test_integration_memory.py.

A failed offload's rollback must give every expert byte back (its new rows were zeroed before the failing
publish), a hybrid model's state pool too; an undo returns each pool to exactly its size before the round;
SGLang's own state allocation is given back before our pages are made; the start-up offload is agreed.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.test_integration_memory import (  # noqa: F401 (fixtures)
    POOL_TOKENS,
    RATIO,
    E,
    fused_shared_experts,
    sglang_moe,
    tokens_per_group,
    vamp,
)
from vamp_sglang.integration.memory import expert_memory as em
from vamp_sglang.integration.memory import expert_memory_hooks as hooks


def experts_exact(vamp):  # noqa: F811
    """Every resident expert's bytes, the resident part of the offloadable tail included, equal the
    weights loaded (offloaded experts read the staging slot, which a forward refills)."""
    resident = {store.layer_id: store.boundary_expert for store in vamp.experts.stores}
    return all(torch.equal(now[:b], loaded[:b]) and torch.equal(now[E:], loaded[E:])  # E: fused shared ones
               for layer, (w13, w2) in zip(vamp.layers, vamp.originals) for b in [resident.get(layer.layer_id, E)]
               for now, loaded in ((layer.w13_weight, w13), (layer.w2_weight, w2)))


@pytest.mark.parametrize("fused_shared_experts", [0, 1])
def test_a_publish_failing_after_the_new_rows_are_zeroed_leaves_every_expert_byte(vamp):  # noqa: F811
    """Issue 19 item 2: the new KV rows (pages just taken from the experts) are zeroed before the publish;
    when the publish then fails, the pages go back under the expert tensors, which must read exactly
    the bytes they held, not zeros (the older test compared only the resident experts)."""
    def publish():
        raise RuntimeError("injected: the scheduler refused the new size")

    _, alloc, memory = vamp.build(publish=publish)
    with pytest.raises(RuntimeError, match="injected"):
        memory.offload(2, memory.tokens_for(2))
    assert (alloc.size, memory.offloaded_groups) == (POOL_TOKENS, 0)
    assert experts_exact(vamp), "a failed offload left zeros (or KV bytes) under the experts"


@pytest.fixture
def hybrid(vamp):  # noqa: F811
    """`vamp` plus a hybrid model's state pool laid out through our `_init_mamba_pool` hook."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from tests.test_radix_hybrid import req_pool

    reqs = req_pool()
    hooks._after_init_mamba_pool(None, reqs)
    vamp.reqs, vamp.states = reqs, hooks._process.states
    no_state = {ComponentType.MAMBA: SimpleNamespace(value=None)}
    vamp.empty_tree = SimpleNamespace(root_node=SimpleNamespace(children={}, component_data=no_state))
    return vamp


def state_sizes(reqs):
    return (int(reqs.mamba_pool.size), int(reqs.mamba_allocator.size), int(reqs.mamba_pool.mamba_cache.temporal.shape[1]),
            sorted(reqs.mamba_allocator.free_slots.tolist()))


def test_a_state_resize_failing_after_the_new_slots_are_zeroed_leaves_experts_and_sglang_as_before(hybrid,
                                                                                                     monkeypatch):
    """Issue 19 item 2, state pool: the new state slots are zeroed by the resize before it completes; a
    failure after that must leave SGLang's state pool and every expert byte as before."""
    _, _, memory = hybrid.build(states=hybrid.states)
    resize, calls = hybrid.states.resize, []

    def resize_then_fail_once(new_slots):
        resize(new_slots)
        calls.append(new_slots)
        if len(calls) == 1:
            raise RuntimeError("injected: the state publish failed after zeroing")

    monkeypatch.setattr(hybrid.states, "resize", resize_then_fail_once)
    before = state_sizes(hybrid.reqs)
    with pytest.raises(RuntimeError, match="injected"):
        memory.offload_state(1, memory.slots_for(1))
    assert state_sizes(hybrid.reqs) == before and memory.offloaded_groups == 0
    assert experts_exact(hybrid), "a failed state offload left zeros under the experts"


def test_undoing_a_kv_offload_round_returns_to_the_size_before_it(vamp):  # noqa: F811
    """Issue 19 item 10: after a round that agreed on less than this rank's gain, the pool is below what
    its groups allow; undoing the next round must return to that size, not to the groups' largest."""
    _, _, memory = vamp.build()
    memory.offload(1, 100)  # an earlier round agreed on less than this rank's gain
    before = memory.pool_sizes()
    memory.offload(1, memory.tokens_for(1))  # this round; another rank refused it
    memory.return_to(before)  # memory.restore(1), the undo before issue 19, ended at 328 tokens, not 300
    assert memory.pool_sizes() == before and before.kv_tokens == 300


def test_undoing_a_restore_round_returns_to_the_size_before_it(vamp):  # noqa: F811
    _, _, memory = vamp.build()
    memory.offload(1, 100)
    before = memory.pool_sizes()
    memory.restore(1)
    memory.return_to(before)  # memory.undo_restore(), the undo before issue 19, ended at 328 tokens, not 300
    assert memory.pool_sizes() == before and before.kv_tokens == 300
    memory.return_to(before)  # a retried undo changes nothing more
    assert memory.pool_sizes() == before


def test_undoing_a_state_offload_round_returns_to_the_size_before_it(hybrid):
    _, _, memory = hybrid.build(states=hybrid.states)
    memory.offload_state(1, 3)
    before = state_sizes(hybrid.reqs)
    sizes = memory.pool_sizes()
    memory.offload_state(1, memory.slots_for(1))
    memory.return_to(sizes)  # memory.undo_state_offload(1), the undo before issue 19, ended at 1364 slots, not 9
    assert state_sizes(hybrid.reqs) == before and memory.pool_sizes() == sizes


def test_undoing_a_restore_from_both_pools_returns_each_to_its_size_before_it(hybrid):
    _, _, memory = hybrid.build(states=hybrid.states, tree_cache=hybrid.empty_tree)
    memory.offload(1, 100)
    memory.offload_state(1, 3)
    before, slots = memory.pool_sizes(), state_sizes(hybrid.reqs)
    memory.restore(2)  # the KV pool's group, then the state pool's
    assert memory.pool_sizes() == em.PoolSizes(0, 0, POOL_TOKENS, 6)
    memory.return_to(before)
    assert memory.pool_sizes() == before and state_sizes(hybrid.reqs) == slots
    assert experts_exact(hybrid)


def test_sglangs_state_allocation_is_given_back_before_the_state_pages_are_created(vamp, monkeypatch):  # noqa: F811
    """Issue 19 item 4: SGLang sized the KV pool counting its state tensors once; on a GPU what they held
    stays in torch's caching allocator, out of reach of the KV buffers' cuMemCreate, unless it is given
    back (emptied, then empty_cache) before the state pool's own pages are created. On host pages: the
    tensors hold no bytes by the time the state reservations are made."""
    from tests.test_radix_hybrid import req_pool
    from vamp_sglang.integration.memory.state_pool import state_tensors

    reqs = req_pool()
    tensors = state_tensors(reqs.mamba_pool)
    held, reserve = [], vamp.backend.reserve

    def reserve_and_look(nbytes):
        held.append(sum(t.untyped_storage().nbytes() for t in tensors))
        return reserve(nbytes)

    monkeypatch.setattr(vamp.backend, "reserve", reserve_and_look)
    hooks._after_init_mamba_pool(None, reqs)
    assert held and set(held) == {0}, f"SGLang's state tensors still held {held[0]} bytes"
    assert state_tensors(reqs.mamba_pool) == tensors and all(bool((t == 0).all()) for t in tensors)
    assert tensors[-1].shape[1] == reqs.mamba_pool.size + 1


@pytest.mark.parametrize("pool", ["kv", "state"])
def test_a_publish_fault_after_the_new_rows_are_zeroed_rolls_everything_back(hybrid, pool):
    """VAMP_SGLANG_FAULT=publish:1 fails each remap at its very end, after SGLang saw the new size."""
    from vamp_sglang.faults import Faults, InjectedFault

    _, alloc, memory = hybrid.build(states=hybrid.states, tree_cache=hybrid.empty_tree)
    grow = memory.offload if pool == "kv" else memory.offload_state
    gain = memory.tokens_for if pool == "kv" else memory.slots_for
    grow(1, 3)  # an earlier round agreed on less than this rank's gain
    before, slots = memory.pool_sizes(), state_sizes(hybrid.reqs)
    memory.faults = Faults.parse("publish:1")
    for remap in (lambda: grow(1, gain(1)), lambda: memory.restore(1)):
        with pytest.raises(InjectedFault, match="publish"):
            remap()
        assert memory.pool_sizes() == before and state_sizes(hybrid.reqs) == slots
        assert alloc.available_size() == alloc.size
        assert experts_exact(hybrid), "a rolled-back remap left other bytes under the experts"
    assert memory.faults.fired["publish"] == 2


class OtherRank:
    """A two-rank controller as this rank sees it: the other rank can add `gain` tokens and refuses
    the `refuses`-th round (0: none)."""

    world_size, timeout_s = 2, 1.0

    def __init__(self, gain, refuses=0):
        self.gain, self.refuses, self.rounds = gain, refuses, 0

    def agree_min(self, round_id, value, purpose=""):
        return min(value, self.gain)

    def all_ok(self, round_id, ok):
        self.rounds += 1
        return ok and self.rounds != self.refuses


@pytest.mark.parametrize("gain, refuses, added", [(10**6, 0, 2 * tokens_per_group()), (100, 0, 100), (10**6, 2, 0)])
def test_the_start_up_offload_is_agreed_by_the_tp_ranks(vamp, gain, refuses, added):  # noqa: F811
    """Issue 19 item 10: --vamp-initial-offload-ratio grows every rank's pool by the smallest gain of any
    rank, or (a rank refused the remap round) leaves every pool as it started."""
    from vamp_sglang.controller.rounds import RankRounds

    _, alloc, memory = vamp.build()
    assert hooks.offload_at_start(memory, RankRounds(OtherRank(gain, refuses), lambda: 0), RATIO) == added
    assert (alloc.size, memory.offloaded_groups) == (POOL_TOKENS + added, 2 if added else 0)
    assert experts_exact(vamp)
