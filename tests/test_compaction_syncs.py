"""Issue 48 defect 5: a restore attempt reads the device back once, not once per cached tree node.

On a GPU every node's KV indices are a device tensor, so a reduction converted to a Python number per node
(`bool(mask.any())`, `int(mask.sum())`) is one blocking stream sync each. On the host the syncs cost nothing,
so these tests count the conversions instead (every `item`, `tolist`, `bool`, `int`, `float` and `__index__`
of a tensor), and check the batched code against the per-node loop it replaced on random trees.
The GPU timing of the same probe is the gpu_check section `compaction_probe`."""

import contextlib
import random
from types import SimpleNamespace

import pytest
import torch

from vamp_sglang.integration.cache import radix_tree
from vamp_sglang.integration.memory import compaction

_CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def host_reads():
    """Count conversions of tensors to Python values (each is a blocking device read on a GPU)."""
    seen = {"reads": 0}
    originals = {name: getattr(torch.Tensor, name) for name in _CONVERSIONS}

    def counting(original):
        def convert(self, *args, **kwargs):
            seen["reads"] += 1
            return original(self, *args, **kwargs)
        return convert

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def random_tree(seed, pool_rows=400, nodes=60):
    """A pool of `pool_rows` rows; cached nodes own disjoint rows, some locked, some held by HiCache, some
    rows held by running requests, the rest free. Returns (tree_cache, core, allocator, kv)."""
    rng = random.Random(seed)
    rows = list(range(1, pool_rows + 1))  # row 0 is SGLang's padding slot
    rng.shuffle(rows)
    values, locked, taken = [], set(), 0
    for node_id in range(nodes):
        n = rng.randint(1, 6)
        values.append((node_id, torch.tensor(rows[taken:taken + n], dtype=torch.int64)))
        taken += n
        if rng.random() < 0.2:
            locked.add(node_id)
    running = rows[taken:taken + rng.choice((0, 0, 3))]  # rows a running request holds, outside the tree
    taken += len(running)
    free = torch.tensor(sorted(rows[taken:]), dtype=torch.int64)
    writing = {rng.randrange(nodes)} if rng.random() < 0.5 else set()
    core = SimpleNamespace(unlocked_device_values=lambda: [(i, v) for i, v in values if i not in locked])
    cache = SimpleNamespace(
        ongoing_write_through={70 + n: SimpleNamespace(node_id=n, publish_node_ids=[]) for n in writing},
        ongoing_load_back={})
    allocator = SimpleNamespace(page_size=1, size=pool_rows, free_pages=free, release_pages=None,
                                get_all_free_pages=lambda: allocator.free_pages)
    rows_ids = torch.arange(pool_rows + 1, dtype=torch.float32).view(-1, 1, 1)
    kv = SimpleNamespace(k_buffer=[rows_ids * (layer + 1) for layer in range(2)],
                         v_buffer=[rows_ids * -(layer + 1) for layer in range(2)])
    return cache, core, allocator, kv


def _per_node_movable(core, cache, keep_tokens):
    """The per-node loop the batched code replaced (the reference): one mask and one read per node."""
    held, hicache = [], compaction._held_by_hicache(cache)
    for node_id, value in core.unlocked_device_values():
        if node_id in hicache or value is None or not value.numel():
            continue
        mask = value > keep_tokens
        if bool(mask.any()):
            held.append((node_id, value, mask))
    return held


def per_node_tail_is_movable(core, cache, allocator, keep_tokens):
    free = allocator.get_all_free_pages()
    used_above = (int(allocator.size) - keep_tokens) - int((free > keep_tokens).sum())
    return used_above == sum(int(mask.sum()) for _, _, mask in _per_node_movable(core, cache, keep_tokens))


def per_node_compact_tail(core, cache, allocator, kv, keep_tokens):
    held = _per_node_movable(core, cache, keep_tokens)
    if not held:
        return 0
    src = torch.cat([value[mask] for _, value, mask in held])
    free = allocator.get_all_free_pages()
    low = free[free <= keep_tokens]
    if low.numel() < src.numel():
        return 0
    dst = low[: src.numel()].to(src.dtype)
    for buffer in [*kv.k_buffer, *kv.v_buffer]:
        buffer[dst] = buffer[src]
    offset = 0
    for _, value, mask in held:
        count = int(mask.sum())
        value[mask] = dst[offset: offset + count]
        offset += count
    allocator.free_pages = torch.cat([free[~torch.isin(free, dst)], src.to(free.dtype)])
    return int(src.numel())


def _use(monkeypatch, core):
    monkeypatch.setattr(radix_tree, "tree_core_of", lambda tree_cache: core)


@pytest.mark.parametrize("nodes", [50, 500])
def test_a_restore_attempt_reads_the_device_once_whatever_the_tree_size(monkeypatch, nodes):
    cache, core, allocator, _ = random_tree(0, pool_rows=8 * nodes, nodes=nodes)
    _use(monkeypatch, core)
    keep = 2 * nodes
    with host_reads() as seen:
        compaction.tail_is_movable(cache, allocator, keep)
    assert seen["reads"] == 1, f"{seen['reads']} host reads over {nodes} nodes (one per attempt expected)"
    with host_reads() as seen:
        held = compaction._movable_tail(cache, keep)
    assert held and seen["reads"] == 1


def test_a_compaction_reads_the_device_a_fixed_number_of_times(monkeypatch):
    reads = []
    for nodes in (50, 500):
        cache, core, allocator, kv = random_tree(1, pool_rows=10 * nodes, nodes=nodes)
        _use(monkeypatch, core)
        with host_reads() as seen:
            moved = compaction.compact_tail(cache, allocator, kv, keep_tokens=5 * nodes)
        assert moved > 0
        reads.append(seen["reads"])
    assert reads[0] == reads[1] <= 2, reads


@pytest.mark.parametrize("seed", range(12))
def test_the_batched_probe_and_compaction_equal_the_per_node_loop(monkeypatch, seed):
    rng = random.Random(seed)
    keep = rng.randint(100, 350)
    new, old = random_tree(seed), random_tree(seed)
    _use(monkeypatch, new[1])
    want = per_node_tail_is_movable(old[1], old[0], old[2], keep)
    assert compaction.tail_is_movable(new[0], new[2], keep) == want
    assert sorted(i for i, *_ in compaction._movable_tail(new[0], keep)) == \
        sorted(i for i, *_ in _per_node_movable(old[1], old[0], keep))
    moved = compaction.compact_tail(new[0], new[2], new[3], keep)
    assert moved == per_node_compact_tail(old[1], old[0], old[2], old[3], keep)
    for (_, a), (_, b) in zip(new[1].unlocked_device_values(), old[1].unlocked_device_values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(new[2].free_pages, old[2].free_pages)
    for a, b in zip([*new[3].k_buffer, *new[3].v_buffer], [*old[3].k_buffer, *old[3].v_buffer], strict=True):
        assert torch.equal(a, b)


def test_a_tree_without_unlocked_rows_is_movable_only_when_nothing_is_used_above(monkeypatch):
    cache, core, allocator, _ = random_tree(2)
    core.unlocked_device_values = list
    _use(monkeypatch, core)
    allocator.free_pages = torch.arange(1, 401)
    assert compaction.tail_is_movable(cache, allocator, 100)
    allocator.free_pages = torch.arange(1, 400)  # row 400 is used, and no node holds it
    assert not compaction.tail_is_movable(cache, allocator, 100)
    assert compaction.compact_tail(cache, allocator, None, 100) == 0
