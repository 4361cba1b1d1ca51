"""What the planner reads off the live VAMP tree: eviction candidates and the price of an eviction (Eq. 2).

The planner weighs evicting against offloading and preemption (paper IV-B) before anything is evicted,
so it needs the nodes SGLang's eviction would take, in SGLang's own order, each with the statistics
Eq. 1 prices it by, and the summed C_c (Eq. 2) of freeing N tokens. These are read-only views of a
`VampTreeCore` (radix_tree.py) handed to the pure walks in vamp_sglang/cache/: `eviction_order` and
`estimate` replay SGLang's device eviction heap (cache/walk.py), taking the leaves from the order the
tree keeps between shortfalls where it keeps one (`kept_order`, cache/leaf_order.py; on SGLang's Rust core, the
mirror radix_rust.py keeps of its tree), `tokens_losing_reuse` says what a
hybrid node's eviction makes unreachable (cache/hybrid.py): a leaf with a state is priced by every
token its eviction strands, its stateless ancestors included.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeNode

from vamp_sglang.cache import EvictionEstimate, HybridTree, estimate, eviction_order, tokens_losing_reuse
from vamp_sglang.integration.cache.radix_tree import VampStatistics, VampTreeCore, tree_core_of
from vamp_sglang.integration.cache.session_refs import SessionRecede
from vamp_sglang.policy.planner import eviction_need_tokens
from vamp_sglang.policy.snapshot import EvictableBlock

if TYPE_CHECKING:  # loading radix_rust loads SGLang's Rust extension: only where that core is built
    from vamp_sglang.integration.cache.radix_rust import MirrorNode, VampRustTreeCore

_FULL = ComponentType.FULL
_MAMBA = ComponentType.MAMBA


class _HybridView(HybridTree[UnifiedTreeNode]):
    """`cache.hybrid.HybridTree` over a live hybrid `VampTreeCore` (device KV and states)."""

    def __init__(self, core: VampTreeCore) -> None:
        self.core = core

    def parent(self, node: UnifiedTreeNode) -> UnifiedTreeNode | None:
        parent = node.parent
        return None if parent is None or parent is self.core.root_node else parent

    def children(self, node: UnifiedTreeNode) -> list[UnifiedTreeNode]:
        return [c for c in node.children.values() if c.component_data[_FULL].value is not None]

    def tokens(self, node: UnifiedTreeNode) -> int:
        return self.core.node_tokens(node)

    def has_state(self, node: UnifiedTreeNode) -> bool:
        return self.core.has_state(node)


class _StatesDropped(_HybridView):
    """The hybrid view once the states in `dropped` are gone (an inner node keeps its KV)."""

    def __init__(self, core: VampTreeCore) -> None:
        super().__init__(core)
        self.dropped: set[UnifiedTreeNode] = set()

    def has_state(self, node: UnifiedTreeNode) -> bool:
        return node not in self.dropped and self.core.has_state(node)


class LostTokens:
    """Tokens each node's eviction makes unreachable, for nodes taken in eviction order: each call
    assumes the nodes asked about before it are gone (a plain tree loses a node's own tokens)."""

    def __init__(self, core: VampTreeCore) -> None:
        self.core = core
        self.view = _HybridView(core) if core.vamp_hybrid else None
        self.gone: set[UnifiedTreeNode] = set()

    def __call__(self, node: UnifiedTreeNode) -> int:
        if self.view is None:
            return self.core.node_tokens(node)
        lost = tokens_losing_reuse(self.view, node, self.gone)
        self.gone.add(node)
        return lost


class _DeviceTreeView:
    """`cache.walk.EvictableTree` over a live `VampTreeCore`, reading only (FULL device tier)."""

    def __init__(self, core: VampTreeCore) -> None:
        self.core = core
        self.priority = core.eviction_strategy.get_priority
        # the key FullComponent heaps by, session refs first when sessions are on, as its removals leave them
        self.recede = None
        if core.components_by_type[_FULL].session_ref_eviction_strategy is not None:
            self.recede = recede = SessionRecede(core)
            self.priority = lambda node: recede.key(node, core.eviction_strategy.get_priority(node))

    def evictable_leaves(self) -> set[UnifiedTreeNode]:
        return self.core.evictable_device_leaves

    def tokens(self, node: UnifiedTreeNode) -> int:
        return self.core.node_tokens(node)

    def parent_if_leaf_after(self, node: UnifiedTreeNode, removed: set) -> UnifiedTreeNode | None:
        """Mirrors `UnifiedTreeCore._is_device_leaf` with `removed` treated as evicted (plain loops:
        this runs for every candidate a decision takes); `node` is the one removed last."""
        if self.recede is not None:
            self.recede.remove(node)
        parent = node.parent
        if parent is None or parent is self.core.root_node or parent.evicted:
            return None
        for cd in parent.component_data:
            if cd.lock_ref > 0:
                return None
        for child in parent.children.values():
            if child not in removed and child.component_data[_FULL].value is not None:
                return None
        return parent


class _MirrorView:
    """`cache.walk.EvictableTree` over the mirror of SGLang's Rust core (radix_rust.py), reading only."""

    def __init__(self, core: VampRustTreeCore) -> None:
        self.core, self.priority, self.recede = core, core.vamp_priority, None

    def evictable_leaves(self) -> set[MirrorNode]:
        return self.core.evictable_device_leaves

    def tokens(self, node: MirrorNode) -> int:
        return node.tokens

    def parent_if_leaf_after(self, node: MirrorNode, removed: set) -> MirrorNode | None:
        parent = node.parent
        if parent.parent is None or parent.lock_ref:
            return None
        for child in parent.children.values():
            if child not in removed:
                return None
        return parent


def _view(core: VampStatistics) -> _DeviceTreeView | _MirrorView:
    if isinstance(core, VampTreeCore):
        return _DeviceTreeView(core)
    if core.vamp_lost:
        raise RuntimeError(f"VAMP's order on SGLang's Rust tree core ended ({core.vamp_lost}): SGLang's own "
                           "eviction decides")
    return _MirrorView(core)


def kept_order(core: VampStatistics) -> Iterator[Any]:
    """The nodes `core`'s eviction would take, in its order, read-only: from the order the tree keeps
    (pricing only the leaves near the front) where it keeps one, else from a heap over every leaf."""
    view = _view(core)
    if core.vamp_leaf_order is None:
        yield from eviction_order(view)
        return
    removed: set[UnifiedTreeNode] = set()
    parents: set[UnifiedTreeNode] = set()  # leaves once `removed` are gone, not yet in the tree
    leaves = core.evictable_device_leaves
    walk = core.vamp_ordered_walk(lambda node: node not in removed and (node in leaves or node in parents),
                                  view.recede.refs if view.recede is not None else None)
    try:
        for node in walk:
            removed.add(node)
            yield node
            parent = view.parent_if_leaf_after(node, removed)
            if parent is not None:
                parents.add(parent)
                walk.push(parent)
    finally:
        walk.close()  # also when the caller stops early: later inserts then file straight into the order


def eviction_candidates(tree_cache: Any, gap_tokens: int, free_tokens: int, running_requests: int,
                        retract_buffer_tokens: int) -> list[EvictableBlock]:
    """Nodes in the order the tree would evict them, taken lazily until they cover the most any plan
    may ask the tree for (`eviction_need_tokens`), each with the prior the tree prices it with."""
    core = tree_core_of(tree_cache)
    need = eviction_need_tokens(gap_tokens, free_tokens, running_requests, retract_buffer_tokens)
    out: list[EvictableBlock] = []
    if need <= 0:
        return out  # nothing to take: no walk (a walk prices the leaves at its front)
    now, covered, lost = core.now_steps(), 0, LostTokens(core) if core.vamp_hybrid else None
    core.vamp_shares.refresh(core.vamp_ledger.hit_rate)  # once: the published priors hold for this step
    prior_of, node_tokens = core.vamp_shares.prior, core.node_tokens
    nodes = []
    for node in kept_order(core):
        tokens, stats = node_tokens(node), node.vamp_stats
        covered += tokens
        nodes.append(node)
        out.append(EvictableBlock(tokens, stats.hits, stats.age_steps(now), prior_of(stats.prior),
                                  None if lost is None else lost(node),
                                  bool(node.backuped)))  # HiCache's host copy (False without)
        if covered >= need:
            break
    if hand_over := getattr(core, "hand_over", None):  # the Rust core's mirror: the eviction that follows takes them
        hand_over(nodes)
    return out


def state_eviction_candidates(tree_cache: Any, need_slots: int) -> list[EvictableBlock]:
    """Hybrid trees: the states SGLang's state eviction would drop, in its order (the MAMBA LRU list from
    its least recent end, locked nodes skipped), until they cover `need_slots`; one slot each. A leaf
    goes with its KV, and so do stateless ancestors left with no state below (`tokens_losing_reuse`);
    an inner node keeps its KV, but a request resuming at it re-prefills back to the nearest state above."""
    core = tree_core_of(tree_cache)
    lru, view, now = core.lru_lists[_MAMBA], _StatesDropped(core), core.now_steps()
    out, gone, node = [], set(), lru.get_lru_no_lock()
    while node is not None and len(out) < need_slots:
        if node in core.evictable_device_leaves:
            lost = tokens_losing_reuse(view, node, gone)
            gone.add(node)
        else:
            lost, above = core.node_tokens(node), view.parent(node)
            while above is not None and not view.has_state(above):
                lost, above = lost + core.node_tokens(above), view.parent(above)
        view.dropped.add(node)
        out.append(EvictableBlock(1, node.vamp_stats.hits, node.vamp_stats.age_steps(now),
                                  core.prior_hit_rate(node), lost))
        node = lru.get_prev_no_lock(node)
    return out


def eviction_plan(tree_cache: Any, n_tokens: int) -> EvictionEstimate:
    """The nodes `tree_cache.evict(EvictParams(num_tokens=n_tokens))` would free now, and their C_c."""
    core = tree_core_of(tree_cache)
    lost = LostTokens(core)
    return estimate(_view(core), n_tokens, lambda node: core.cost_of_losing_s(node, lost(node)), kept_order(core))


def estimate_eviction(tree_cache: Any, n_tokens: int) -> tuple[int, float]:
    """(tokens freed, summed C_c in seconds) if the tree were asked to free `n_tokens` now; read-only."""
    result = eviction_plan(tree_cache, n_tokens)
    return result.tokens, result.cost_s
