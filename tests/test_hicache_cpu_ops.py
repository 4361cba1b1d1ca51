"""vamp_sglang/cpu/hicache.py: HiCache's `direct` io backend answered in torch on CPU (issue 22).

The ops copy exactly the rows SGLang's CUDA ops would (host layouts from MHATokenToKVPoolHost.init_kv_buffer,
pool_host/mha.py:305): a backup then a load round-trips every K and V value of the chosen tokens, and touches
no other row."""

import pytest
import torch

from vamp_sglang.cpu import hicache

LAYERS, HEADS, DIM, DEVICE_ROWS, PAGE = 3, 2, 4, 16, 2


class _Host:
    """The attributes of an MHATokenToKVPoolHost the hooks read."""

    def __init__(self, layout, device_k, device_v):
        self.layout, self.page_size, self.target_layer_num = layout, PAGE, LAYERS
        self.device_k_buffers, self.device_v_buffers = tuple(device_k), tuple(device_v)
        if layout == "layer_first":
            kv = torch.zeros(2, LAYERS, 8, HEADS, DIM)
            self.k_buffer, self.v_buffer = kv[0], kv[1]
            self.host_kv_data_refs = [kv[0][i] for i in range(LAYERS)] + [kv[1][i] for i in range(LAYERS)]
        else:
            kv = torch.zeros(2, 4, LAYERS, PAGE, HEADS, DIM)
            self.k_buffer, self.v_buffer = kv[0], kv[1]


def _device():
    return ([torch.randn(DEVICE_ROWS, HEADS, DIM) for _ in range(LAYERS)],
            [torch.randn(DEVICE_ROWS, HEADS, DIM) for _ in range(LAYERS)])


def _never(*args, **kwargs):
    raise AssertionError("the direct backend must not reach SGLang's CUDA ops")


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_backup_then_load_round_trips_the_rows(layout):
    k, v = _device()
    host = _Host(layout, k, v)
    device_rows, host_rows = torch.tensor([3, 4, 9, 10]), torch.tensor([2, 3, 6, 7])
    hicache.backup_from_device_all_layer(_never, host, None, host_rows, device_rows, "direct")
    k2 = [torch.zeros_like(t) for t in k]
    v2 = [torch.zeros_like(t) for t in v]
    host.device_k_buffers, host.device_v_buffers = tuple(k2), tuple(v2)
    targets = torch.tensor([0, 1, 5, 6])
    for layer in range(LAYERS):
        hicache.load_to_device_per_layer(_never, host, None, host_rows, targets, layer, "direct")
    for layer in range(LAYERS):
        assert torch.equal(k2[layer][targets], k[layer][device_rows])
        assert torch.equal(v2[layer][targets], v[layer][device_rows])
        others = torch.ones(DEVICE_ROWS, dtype=torch.bool)
        others[targets] = False
        assert not k2[layer][others].any() and not v2[layer][others].any()


def test_page_first_direct_puts_each_token_in_its_page_slot():
    k, v = _device()
    host = _Host("page_first_direct", k, v)
    hicache.backup_from_device_all_layer(_never, host, None, torch.tensor([5]), torch.tensor([7]), "direct")
    assert torch.equal(host.k_buffer[5 // PAGE, 1, 5 % PAGE], k[1][7])
    assert torch.equal(host.v_buffer[5 // PAGE, 2, 5 % PAGE], v[2][7])


def test_other_io_backends_and_out_of_range_layers_go_to_sglang():
    calls = []
    host = _Host("layer_first", *_device())
    hicache.load_to_device_per_layer(lambda *a, **kw: calls.append("load"), host, None, None, None, 0, "kernel")
    hicache.backup_from_device_all_layer(lambda *a, **kw: calls.append("backup"), host, None, None, None, "kernel")
    assert calls == ["load", "backup"]
    assert hicache.load_to_device_per_layer(_never, host, None, None, None, LAYERS, "direct") is None


def test_host_register_is_skipped_for_cpu_memory_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine registers")
    assert hicache._host_register(_never, torch.zeros(4)) is None


def test_transfer_engine_streams_can_be_synchronized():
    class Engine:
        device_to_host_stream = torch.cpu.Stream()
        host_to_device_stream = torch.cpu.Stream()

    engine = Engine()
    hicache._after_transfer_engine_init(None, engine, "direct")
    engine.device_to_host_stream.synchronize()
    engine.host_to_device_stream.synchronize()
    with torch.cpu.stream(engine.host_to_device_stream):
        pass


def test_a_whole_load_reports_its_tokens_and_time_once(monkeypatch):
    seen = []
    monkeypatch.setattr(hicache, "LOAD_OBSERVERS", [lambda tokens, s: seen.append((tokens, s))])
    host = _Host("layer_first", *_device())
    for layer in range(LAYERS):
        hicache.load_to_device_per_layer(_never, host, None, torch.tensor([1, 2]), torch.tensor([3, 4]), layer, "direct")
    assert len(seen) == 1 and seen[0][0] == 2 and seen[0][1] > 0
