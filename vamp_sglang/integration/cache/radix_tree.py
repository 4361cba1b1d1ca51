"""SGLang's radix tree with per-node reuse statistics and p_eff-ordered eviction (paper Eq. 1-2).

SGLang 0.5.23 builds `UnifiedRadixCache` over a pluggable tree core; its default Rust core takes
only the eight built-in eviction policies by name, so `VampTreeCore` subclasses the Python core
(`UnifiedTreeCore`, the one SGLang itself uses for sessions and KV sharding) and adds per-node
`NodeStats`. Where the tree has no sessions, host tier or hybrid states, `VampRustTreeCore`
(radix_rust.py) keeps the same statistics and order beside the Rust core instead, from a mirror of its tree;
what both keep is `VampStatistics`. Everything else stays SGLang's: the tree walk, locks, HiCache tiers, session refs and
paging. `VampStrategy` is `--radix-eviction-policy vamp`: nodes not expected back first, by lowest
p_eff (Eq. 1), then farthest expected next use (cache/ordering.py), read from the core that keeps the
statistics. How these enter SGLang is
`radix_backend`; what the planner reads off the tree is `radix_eviction`.

Hits are counted at admission (`VampTreeCore.record_admission`, walking the locked `req.last_node`
to the root; never at match: waiting requests are re-matched every round). We do not reuse SGLang's
insert-time `hit_count`: it drives HiCache's write-through threshold (changing it would change
HiCache), write-back mode skips it, and only admission sees, in one place, the matched prefix AND
the prompt length, which give the request's hit rate: the tree-wide rate of Eq. 1 (the runtime's
one `AdmissionLedger`, which the tree reads) and the class of the nodes this request then writes
(`checkpoint_into_tree`, `NodeStats.prior`): a node's r_hit prior is its writer class's
observed reuse share (`ReuseShares`, cache/reuse_share.py), counted here from the tokens each class
writes and the tokens whose node sees its first admitted hit.

Hybrid models (a MAMBA component: Qwen3-Next's linear-attention state) follow SGLang's reuse rule
(cache/hybrid.py): a match ends at the deepest node holding a state, so a stateless leaf is evicted
first (priority below every p_eff) and costs nothing.

The eviction order is kept between shortfalls (cache/leaf_order.py): the evictable leaf set SGLang
maintains (`evictable_device_leaves`, updated on insert, split, lock, unlock and eviction) reports
each change to a `LeafOrder`, and both the planner's read-only walk (`vamp_eviction_order`) and the
eviction SGLang runs (its FULL component's device walk, replaced on this tree) take leaves from it in
exactly the order SGLang's heap over every leaf would give, pricing only the leaves near the front.
With SGLang's radix-native sessions the order is SGLang's session-ref key around ours, kept the same way
(a session's coverage moving re-files the leaves on its path). Trees where that order is not ours alone
keep SGLang's heap: hybrid trees (states come and go outside the leaf set) and eviction policies other
than `vamp`. Priorities are memoised per node for the current step and published priors (a node's own
change drops its entry), so the planner's walk and the eviction that follows share one computation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore, UnifiedTreeNode
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from vamp_sglang.cache import AdmissionLedger, CostOrder, LeafOrder, NodeStats, OrderedWalk, ReuseShares

_FULL = ComponentType.FULL
_MAMBA = ComponentType.MAMBA
DEAD_PRIORITY = -1.0  # below every p_eff: a hybrid node no match can end in goes first


class VampStrategy(EvictionStrategy):
    """`--radix-eviction-policy vamp`: the priority comes from the tree core that owns the stats."""

    def __init__(self) -> None:
        self._priority: Callable[[UnifiedTreeNode], tuple] | None = None

    def bind(self, priority: Callable[[UnifiedTreeNode], tuple]) -> None:
        self._priority = priority

    def get_priority(self, node: UnifiedTreeNode) -> tuple:
        if self._priority is None:
            raise RuntimeError("--radix-eviction-policy vamp needs --radix-cache-backend vamp "
                               "(only that tree keeps the hit and recency statistics it orders by)")
        return self._priority(node)


class VampStatistics:
    """What a VAMP tree core keeps beside SGLang's tree, whichever core holds the tree: the step clock, the
    admission ledger, the writer classes' reuse shares (`NodeStats.prior`), per-node priorities memoised for
    the current step, and the eviction order kept between shortfalls. A node here is anything with `id`,
    `parent` (None at a root), `priority` and `vamp_stats`: SGLang's Python tree nodes (`VampTreeCore`) or
    the mirror of its Rust core's tree (radix_rust.py). A core also gives `vamp_node(node_id)`, `node_tokens(node)`
    and SGLang's `evictable_size()`/`protected_size()`."""

    vamp_leaf_order: LeafOrder | None
    vamp_sessions: bool

    def init_statistics(self, order: CostOrder) -> None:
        self.vamp_order = order
        self.vamp_step_fn: Callable[[], int] = lambda: 0
        self.vamp_ledger = AdmissionLedger()  # replaced by the runtime's ledger once it exists
        self.vamp_shares = ReuseShares()  # the r_hit priors of nodes, by writer class
        self.vamp_priorities: dict[int, tuple] = {}  # node id -> priority, valid for vamp_priority_key
        self.vamp_priority_key: tuple[int, int] | None = None  # (step, published priors' version)
        self.vamp_priced: Callable[[Any], tuple] | None = None  # prices into the memo for that key
        self.vamp_evicted_tokens = 0
        self.vamp_write_prior: float | None = None  # hit rate of the request inserting right now
        self.vamp_leaf_order = None  # set where the order is p_eff's alone
        self.vamp_walk: OrderedWalk | None = None  # the eviction SGLang is running, if any
        self.vamp_sessions = False  # SGLang's radix-native sessions order the leaves first
        self.vamp_restored_tokens = 0  # device KV an insert gave back to host-only (HiCache) nodes, in all
        self.vamp_changes = 0  # changes to the tree or its statistics seen (the Rust core's mirror counts them)

    def now_steps(self) -> int:
        return int(self.vamp_step_fn())

    @contextmanager
    def written_by(self, prior: float | None) -> Iterator[None]:
        """Nodes created inside inherit `prior`, the writing request's prefix-hit rate (NodeStats); the
        tokens written count towards its class's reuse share."""
        self.vamp_write_prior = prior
        cached_tokens, restored_tokens = self.evictable_size() + self.protected_size(), self.vamp_restored_tokens
        try:
            yield
        finally:
            self.vamp_write_prior = None
            restored = self.vamp_restored_tokens - restored_tokens  # its writer's, counted when it was written
            self.vamp_shares.wrote(prior, self.evictable_size() + self.protected_size() - cached_tokens - restored)

    def record_admission(self, node_id: int, hit_tokens: int, requested_tokens: int, first: bool) -> None:
        """A request was admitted with its prefix matched up to `node_id` (locked by SGLang just now);
        `first`: its first admission (a retracted request's return or a later chunk is no new hit)."""
        now = self.now_steps()
        node = self.vamp_node(node_id)
        self.vamp_changes += 1
        while node is not None and node.parent is not None:  # the root has no statistics that count
            if first and not node.vamp_stats.hits:
                self.vamp_shares.reused(node.vamp_stats.prior, self.node_tokens(node),
                                        now - node.vamp_stats.created_step)
            node.vamp_stats.admit(now, count_hit=first)
            self.vamp_priorities.pop(node.id, None)
            node = node.parent
        if first:
            self.vamp_ledger.record(hit_tokens, requested_tokens)

    def priced_now(self) -> Callable[[Any], tuple]:
        """`vamp_priority` of a node with a state (every node of a plain tree) at the current step and published
        priors, memoised: a walk runs within one step, so it checks the step and priors once, here."""
        now, shares = self.now_steps(), self.vamp_shares
        key = (now, shares.refresh(self.vamp_ledger.hit_rate))
        if key != self.vamp_priority_key:
            self.vamp_priorities.clear()
            self.vamp_priority_key = key
            self.vamp_priced = self._pricer(now)
        return self.vamp_priced

    def _pricer(self, now: int) -> Callable[[Any], tuple]:
        memo, order, shares, key = self.vamp_priorities, self.vamp_order, self.vamp_shares, self.vamp_priority_key
        ids = self.vamp_leaf_order is not None and self.vamp_leaf_order.ties_by_id  # the key ends with the node id

        def priority(node: Any) -> tuple:
            current = self.vamp_priority_key is key  # else a walk left open past its step: its own step, memo aside
            value = memo.get(node.id) if current else None
            if value is None or value[1] != node.priority:  # SGLang raises a request priority after the touch
                # that dropped the entry, and a walk left open may have priced the node in between
                stats = node.vamp_stats
                ranked = order.priority(stats, now, shares.prior(stats.prior), shares.gap_steps(stats.prior))
                value = (1, node.priority, *ranked, node.id) if ids else (1, node.priority, *ranked)
                if current:
                    memo[node.id] = value
            return value
        return priority

    def vamp_ordered_walk(self, admits: Callable[[Any], bool],
                          session_refs: Callable[[Any], int] | None = None) -> OrderedWalk:
        """Evictable leaves in the order SGLang's heap would give (`vamp_priority`, inside the session-ref key
        with sessions) from the kept order (needs `vamp_leaf_order`); leaves that become evictable while it is
        open (the parents its own evictions free) join it. `session_refs`: a prediction's counts for the parents
        it pushes (session_refs.py); default, the nodes' own."""
        priority = self.priced_now()  # refreshes the published priors the walk files never-hit nodes with
        if self.vamp_sessions:
            priced, refs_of = priority, session_refs or (lambda node: node.component_data[_FULL].session_ref)

            def priority(node: Any) -> tuple:  # FullComponent._session_ref_eviction_strategy's key
                refs = refs_of(node)
                return (refs > 0, refs, priced(node))
        return self.vamp_leaf_order.walk(self.now_steps(), self.vamp_shares.published,
                                         self.vamp_shares.published_gaps, priority, admits)

    def prior_hit_rate(self, node: Any) -> float:
        """The r_hit prior this node is priced with: its writer class's observed reuse share."""
        self.vamp_shares.refresh(self.vamp_ledger.hit_rate)
        return self.vamp_shares.prior(node.vamp_stats.prior)

    def cost_of_losing_s(self, node: Any, lost_tokens: int) -> float:
        """C_c (Eq. 2) of `node` when its eviction makes `lost_tokens` unreachable (0: nothing lost)."""
        if not lost_tokens:
            return 0.0
        return self.vamp_order.cost_s(lost_tokens, node.vamp_stats, self.now_steps(), self.prior_hit_rate(node))


class VampTreeCore(VampStatistics, UnifiedTreeCore):
    """SGLang's Python tree core plus `node.vamp_stats` on every node and the admission ledger."""

    def __init__(self, params: Any, components: dict, order: CostOrder) -> None:
        self.init_statistics(order)  # before super().__init__: reset() already creates the root through _new_node
        super().__init__(params, components)
        self.vamp_hybrid = _MAMBA in self.components_by_type  # linear-attention states in the tree
        if isinstance(self.eviction_strategy, VampStrategy):
            self.eviction_strategy.bind(self.vamp_priority)
            full = self.components_by_type[_FULL]
            # SGLang's own session-ref key (--enable-session-radix-cache) is one the kept order ranks by
            self.vamp_sessions = full.session_ref_eviction_strategy == full._session_ref_eviction_strategy
            if not self.vamp_hybrid and (full.session_ref_eviction_strategy is None or self.vamp_sessions):
                c = order.coefficients
                describe = _describe_in_sessions if self.vamp_sessions else _describe
                self.vamp_leaf_order = LeafOrder(c.alpha, c.tau_steps, describe, self.vamp_sessions)
                self._watch_leaves()
                if self.vamp_sessions:
                    for name in ("_advance_session_coverage", "_dec_session_coverage", "_recede_session_coverage"):
                        setattr(full, name, self._refiling_after(getattr(full, name)))
                full._evict_device_start = self._vamp_evict_start  # SGLang's heap over every leaf, replaced
                full._evict_device_next_node = self._vamp_evict_next
                full._evict_device_end = self._vamp_evict_end

    # --- the eviction order kept between shortfalls ----------------------------------------------
    def reset(self) -> None:
        super().reset()
        if getattr(self, "vamp_leaf_order", None) is not None:
            self._watch_leaves()

    def _watch_leaves(self) -> None:
        order = self.vamp_leaf_order
        order.clear()
        self.evictable_device_leaves = _WatchedLeaves(self.evictable_device_leaves, order)
        for node in self.evictable_device_leaves:
            order.add(node)

    def _refiling_after(self, move: Callable[..., None]) -> Callable[..., None]:
        """A session's coverage move (FullComponent's, walking from `leaf` towards the root), then the evictable
        leaves on that path re-filed: their rank holds their session references.

        A move inside a device eviction (a host eviction that HiCache's write-back runs to make room for the
        victim's copy) must not reorder that eviction: SGLang's heap keyed every leaf when the walk started
        (`FullComponent._evict_device_start`) and keeps those keys. So the leaves on the path join the open
        walk at the key they have before the move, and are re-filed for later walks only."""
        def moved(session_id: str, leaf: UnifiedTreeNode, *args: Any) -> None:
            leaves, root, walk = self.evictable_device_leaves, self.root_node, self.vamp_walk
            path = []
            node = leaf
            while node is not None and node is not root:
                if node in leaves:
                    path.append(node)
                node = node.parent
            if walk is not None and walk.open:
                for node in path:
                    walk.push(node)  # keyed now, before the move, as SGLang's heap keyed it
            move(session_id, leaf, *args)
            for node in path:
                if node not in leaves:
                    continue
                if walk is not None and walk.open:
                    self.vamp_leaf_order.place(node)  # for later walks; the open one keeps its key
                else:
                    self.vamp_leaf_order.add(node)
        return moved

    def _vamp_evict_start(self, request_cnt: int) -> None:
        full = self.components_by_type[_FULL]
        full._evict_device_request_cnt = request_cnt
        self.vamp_walk = self.vamp_ordered_walk(self.evictable_device_leaves.__contains__)

    def _vamp_evict_next(self, tracker: dict, device_frees: Any, host_frees: Any, cache_actions: Any) -> Any:
        """SGLang's `FullComponent._evict_device_next_node`: the next leaf, until the request is met."""
        if tracker[_FULL] >= self.components_by_type[_FULL]._evict_device_request_cnt:
            return None
        node = next(self.vamp_walk, None)
        return None if node is None else node.id

    def _vamp_evict_end(self) -> None:
        if self.vamp_walk is not None:
            self.vamp_walk.close()
        self.vamp_walk = None

    # --- statistics kept through SGLang's own node life cycle ------------------------------------
    def _new_node(self, priority: int = 0) -> UnifiedTreeNode:
        node = super()._new_node(priority)
        node.vamp_stats = NodeStats(self.now_steps(), prior=self.vamp_write_prior)
        return node

    def _unevict_node_on_insert(self, node: UnifiedTreeNode, fresh_value: Any, session_id: Any = None) -> None:
        """An insert re-fills a host-only node's device KV: the node keeps its first writer, and its tokens
        count for that writer's class, not for the request inserting now (written_by leaves them out)."""
        super()._unevict_node_on_insert(node, fresh_value, session_id)
        self.vamp_restored_tokens += self.node_tokens(node)

    def _split_node(self, key: Any, child: UnifiedTreeNode, split_len: int) -> tuple:
        new_node, action = super()._split_node(key, child, split_len)
        new_node.vamp_stats = child.vamp_stats.copy()
        return new_node, action

    def _touch_node(self, node: UnifiedTreeNode) -> None:
        super()._touch_node(node)  # insert walks touch every node they write through
        node.vamp_stats.touch(self.now_steps())
        self.vamp_priorities.pop(node.id, None)
        if self.vamp_leaf_order is not None and node in self.evictable_device_leaves:
            self.vamp_leaf_order.add(node)  # a leaf the insert ends in: the kept order must see its new use

    # --- cost view --------------------------------------------------------------------------------
    def vamp_node(self, node_id: int) -> UnifiedTreeNode:
        return self.node_by_id(node_id)

    def node_tokens(self, node: UnifiedTreeNode) -> int:
        return self.components_by_type[_FULL].reclaimable_value_len(node)

    def has_state(self, node: UnifiedTreeNode) -> bool:
        """A hybrid node holds a linear-attention state checkpoint (on device) at its end."""
        return node.component_data[_MAMBA].value is not None

    def vamp_priority(self, node: UnifiedTreeNode) -> tuple:
        """(dead first, the request priority SGLang keeps on the node, then CostOrder's).

        `node.priority` is SGLang's own (the highest `InsertParams.priority` written through the
        node, as its `priority` policy orders by): a lower one goes first, so priorities set by
        users hold under VAMP too; with none set (all 0) the order is CostOrder's alone."""
        if self.vamp_hybrid and not self.has_state(node):  # states come and go outside our memo
            return (0, node.priority, DEAD_PRIORITY, node.vamp_stats.last_step, node.vamp_stats.created_step)
        return self.priced_now()(node)

    def device_nodes(self) -> list[UnifiedTreeNode]:
        return [n for n in self._node_arena.values() if n is not self.root_node and not n.evicted]

    def unlocked_device_values(self) -> list[tuple[int, Any]]:
        """(node id, its KV indices) of every node no request holds and HiCache has no host copy of (compaction.py
        moves their rows; a host copy's transfers captured the rows they read)."""
        return [(n.id, n.component_data[_FULL].value) for n in self.device_nodes()
                if not any(cd.lock_ref > 0 for cd in n.component_data) and n.component_data[_FULL].host_value is None]


class VampUnifiedRadixCache(UnifiedRadixCache):
    """SGLang's unified cache over `VampTreeCore`: tags what a request writes, counts what is evicted."""

    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        # SGLang's one path from a request into the tree (after prefill chunks, at finish, at retraction)
        with self.tree_core.written_by(getattr(req, "vamp_prior", None)):
            super().checkpoint_into_tree(req, up_to=up_to, **kwargs)

    def update_eviction_metrics(self, num_evicted: int, start_time: float) -> None:
        self.tree_core.vamp_evicted_tokens += num_evicted
        super().update_eviction_metrics(num_evicted, start_time)


def _describe(node: UnifiedTreeNode) -> tuple:
    stats = node.vamp_stats
    return (node.priority, stats.hits, stats.last_step, stats.created_step, stats.prior)


def _describe_in_sessions(node: UnifiedTreeNode) -> tuple:
    stats, refs = node.vamp_stats, node.component_data[_FULL].session_ref
    return ((refs > 0, refs, node.priority), stats.hits, stats.last_step, stats.created_step, stats.prior)


class _WatchedLeaves(set):
    """SGLang's evictable device leaf set, reporting each change to the kept order (SGLang only
    calls `add` and `discard` on it)."""

    def __init__(self, leaves: set, order: LeafOrder) -> None:
        super().__init__(leaves)
        self.order = order

    def add(self, node: UnifiedTreeNode) -> None:
        super().add(node)
        self.order.add(node)

    def discard(self, node: UnifiedTreeNode) -> None:
        super().discard(node)
        self.order.discard(node)

    def add_unfiled(self, node: Any) -> None:
        """A leaf whose filing in the kept order its caller does later (radix_rust.py's `_HandedOver`)."""
        super().add(node)

    def remove(self, node: UnifiedTreeNode) -> None:
        super().remove(node)
        self.order.discard(node)

    def clear(self) -> None:
        super().clear()
        self.order.clear()


def tree_core_of(tree_cache: Any) -> VampTreeCore:
    core = getattr(tree_cache, "tree_core", None)
    if not isinstance(core, VampStatistics):
        raise TypeError(f"expected a tree built with --radix-cache-backend vamp, got {type(tree_cache).__name__} "
                        f"with core {type(core).__name__}")
    return core
