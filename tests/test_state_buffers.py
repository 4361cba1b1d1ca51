"""GrowableStateBuffers on real host pages: a layer-strided `[layers, slots, ...]` tensor whose every layer
grows at its tail through the same tensor object, exact page arithmetic per kind, shrink and rollback."""

import pytest
import torch

from vamp_sglang.memory.backend import VmmRuleError
from vamp_sglang.memory.backend_choice import select_backend
from vamp_sglang.memory.journal import Journal
from vamp_sglang.memory.state_buffers import GrowableStateBuffers, StateKind

GRAN = 64 * 1024
CONV = StateKind((96, 3), torch.float32)  # 1152 B a slot: 56 slots a page
SSM = StateKind((2, 32, 32), torch.float32)  # 8 KiB a slot: 8 slots a page


@pytest.fixture
def backend():
    be = select_backend("host", "cpu", granularity_bytes=GRAN)
    yield be
    be.close()


def pages(backend, n):
    return [backend.create(GRAN) for _ in range(n)]


def fill(buffers):
    for k, t in enumerate(buffers.tensors):
        for layer in range(buffers.layers):
            t[layer].copy_(torch.arange(t[layer].numel(), dtype=t.dtype).view_as(t[layer]) + 1000 * layer + k)


def test_every_layer_grows_at_its_tail_through_the_same_tensor(backend):
    state = GrowableStateBuffers(backend, [CONV, SSM], layers=3, initial_rows=9, max_rows=64)
    sglang_conv = torch.empty(0)  # SGLang's own tensor objects, re-pointed like MambaPool's
    state.view_into(sglang_conv, 0, 9)
    ids, ptrs = [id(t) for t in state.tensors], [t.data_ptr() for t in state.tensors]
    fill(state)
    before = state.checksums()
    # 9 rows: conv 1 page, ssm 2 pages a layer; 20 rows: conv 1, ssm 3
    assert state.pages_for(9) == 3 * (1 + 2) and state.pages_for(20) == 3 * (1 + 3)
    state.grow_to(20, pages(backend, 3))
    assert [id(t) for t in state.tensors] == ids and [t.data_ptr() for t in state.tensors] == ptrs
    assert state.tensors[1].shape == (3, 20, 2, 32, 32)
    assert state.checksums(9) == before  # every layer's old rows kept
    for layer in range(3):  # each layer's slice is contiguous and its new rows are mapped memory
        assert state.tensors[1][layer].is_contiguous()
        state.tensors[1][layer, 19].fill_(layer + 0.5)
    assert float(state.tensors[1][2, 19, 1, 31, 31]) == 2.5
    assert float(state.tensors[1][1, 19, 0, 0, 0]) == 1.5  # layers do not overlap
    state.view_into(sglang_conv, 0, 20)
    assert torch.equal(sglang_conv, state.tensors[0])
    state.close()


def test_rows_for_pages_is_the_most_a_page_budget_holds(backend):
    state = GrowableStateBuffers(backend, [CONV, SSM], layers=2, initial_rows=1, max_rows=100)
    assert state.rows_for_pages(state.pages_for(1)) == 8  # one ssm page holds 8 slots
    assert state.rows_for_pages(state.pages_for(1) - 1) == 0
    assert state.rows_for_pages(state.pages_for(57)) == 64  # conv needs its 2nd page at 57, ssm 8 pages hold 64
    assert state.rows_for_pages(10 ** 6) == 100  # capped by the reservation
    state.close()


def test_shrink_returns_the_pages_and_unmaps_them(backend):
    state = GrowableStateBuffers(backend, [CONV, SSM], layers=2, initial_rows=8, max_rows=64)
    fill(state)
    before = state.checksums(8)
    base_pages = state.pages_for(8)
    state.grow_to(40, pages(backend, state.pages_for(40) - base_pages))
    ssm_tail = state.tensors[1][1, 39].data_ptr()
    handles = state.shrink_to(8)
    assert len(handles) == state.pages_for(40) - base_pages
    assert state.tensors[1].shape == (2, 8, 2, 32, 32) and state.checksums() == before
    assert not backend.is_mapped(ssm_tail, 4)
    state.grow_to(40, handles)  # the same pages map back in grow_to's order
    assert state.checksums(8) == before
    state.close()


def test_a_failed_grow_inside_a_journal_rolls_back(backend):
    state = GrowableStateBuffers(backend, [CONV, SSM], layers=2, initial_rows=8, max_rows=64)
    fill(state)
    before, rows = state.checksums(), state.rows
    extra = pages(backend, state.pages_for(24) - state.pages_for(8))
    journal = Journal()
    state.grow_to(24, extra, journal)
    tail = state.tensors[1][1, 23].data_ptr()
    assert state.rows == 24 and backend.is_mapped(tail, 4)
    journal.rollback()
    assert state.rows == rows and state.tensors[0].shape[1] == 8 and state.checksums() == before
    assert not backend.is_mapped(tail, 4)
    with pytest.raises(VmmRuleError, match="takes"):
        state.grow_to(24, extra[:-1])
    assert state.rows == 8
    for handle in extra:
        backend.release(handle)
    state.close()


def test_bad_sizes_are_refused_before_anything_is_reserved(backend):
    for kwargs, message in (({"initial_rows": 0, "max_rows": 8}, "initial_rows"),
                            ({"initial_rows": 9, "max_rows": 8}, "max_rows"),
                            ({"initial_rows": 1, "max_rows": 8, "kinds": []}, "kinds")):
        kinds = kwargs.pop("kinds", [CONV])
        with pytest.raises(ValueError, match=message):
            GrowableStateBuffers(backend, kinds, layers=2, **kwargs)
    assert backend.live_counts().reservations == 0
