"""Compaction with HiCache (issue 22): a tree node HiCache holds a host copy of, or is writing back or loading,
keeps its device rows. Moving them is safe for the host copy itself (it is indexed by host rows) but HiCache's
in-flight transfers captured the device rows when submitted, so the simple correct rule is to leave every such
node where it is; the tail then counts as not movable and the restore waits or evicts instead."""

from types import SimpleNamespace

import torch

from vamp_sglang.integration.cache import radix_tree
from vamp_sglang.integration.memory import compaction


class _Cd:
    def __init__(self, value, host_value=None):
        self.value, self.host_value, self.lock_ref = value, host_value, 0


class _Node:
    def __init__(self, node_id, rows, host=False):
        self.id = node_id  # component_data is indexed by ComponentType; FULL is 0
        self.component_data = [_Cd(torch.tensor(rows, dtype=torch.int64), torch.tensor(rows) if host else None)]


def _tree(nodes, writing=(), loading=()):
    core = SimpleNamespace(device_nodes=lambda: nodes)  # what VampTreeCore reads of its nodes here
    core.unlocked_device_values = lambda: radix_tree.VampTreeCore.unlocked_device_values(core)
    cache = SimpleNamespace(
        tree_core=core,
        ongoing_write_through={70 + n: SimpleNamespace(node_id=n, publish_node_ids=[n]) for n in writing},
        ongoing_load_back={80 + n: SimpleNamespace(node_id=n) for n in loading})
    return cache, core


def _movable(monkeypatch, nodes, **kw):
    cache, core = _tree(nodes, **kw)
    monkeypatch.setattr(radix_tree, "tree_core_of", lambda tree_cache: core)
    return {int(value[mask][0]) for _, value, mask, _ in compaction._movable_tail(cache, keep_tokens=10)}


def test_nodes_with_a_host_copy_or_a_transfer_keep_their_rows(monkeypatch):
    nodes = [_Node(1, [11, 12]), _Node(2, [13], host=True), _Node(3, [14]), _Node(4, [15]), _Node(5, [16])]
    assert _movable(monkeypatch, nodes, writing=(3,), loading=(4,)) == {11, 16}


def test_without_hicache_every_unlocked_tail_node_moves(monkeypatch):
    nodes = [_Node(1, [11]), _Node(2, [13])]
    cache, core = _tree(nodes)
    del cache.ongoing_write_through, cache.ongoing_load_back
    monkeypatch.setattr(radix_tree, "tree_core_of", lambda tree_cache: core)
    assert {int(v[m][0]) for _, v, m, _ in compaction._movable_tail(cache, keep_tokens=10)} == {11, 13}
