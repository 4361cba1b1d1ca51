"""VAMP's statistics and eviction order beside SGLang's Rust tree core (issue 23: the tree within 2x of it).

SGLang 0.5.23's Rust core takes only its built-in policies by name and hands out no nodes, but it names nodes by
stable ids, tells a path's ids, spans and child counts (`collect_path_info`), and its cache's eviction loop takes
each victim's id from `evict_device_next_node`. So `VampRustTreeCore` keeps a mirror of the tree (`MirrorNode`)
and names VAMP's victims from the kept order (cache/leaf_order.py); the Rust core matches, inserts, locks, frees.

After a match or an insert ending at a node it does not know, the mirror reads that node's path and files each
new node under its parent by the child key at its first token. A new node whose child key its parent already has
is a split (the prefix half gets a new id, the old id keeps the suffix): the old child moves under it, which takes
a copy of its statistics (`VampTreeCore._split_node`). An insert touches every node on its path; a match touches
nothing. Locks are counted along the path: an evictable leaf has no child and no lock. Plain trees only (sessions,
HiCache and hybrid states need the Python core; `--vamp-tree-core auto` picks per tree: `refusal` here).

Every change to the mirror is counted (`vamp_changes`), so the eviction right after a decision takes the victims
the decision's walk named (`hand_over`) while nothing changed. If the mirror fails to follow (an error in our code,
a node that frees other than the mirror holds), VAMP's order ends on this tree and the Rust core's own LRU order
evicts from then on (`_lose`). A node wrongly named unlocked leaf would panic the Rust core for good (or lose a
running request's rows to compaction), so the mirror's evictable and protected tokens are checked against the Rust
core's (O(1)) first. On an EAGLE tree (bigram keys) a match's token key is read as the bigram key it stands for.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.tree_core_registry import resolve_tree_core_backend
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import EvictDeviceNextNodeResult

from vamp_sglang.cache import CostOrder, LeafOrder, NodeStats
from vamp_sglang.integration.cache.radix_tree import VampStatistics, _describe, _WatchedLeaves

_FULL = ComponentType.FULL
logger = logging.getLogger(__name__)


def refusal(params: Any) -> str | None:
    """Why this tree cannot carry VAMP's order on the Rust core (None: it can): what the mirror does not follow,
    and SGLang's own reasons to build its Python core instead (platform, PyTorch version, device)."""
    if params.enable_session_radix_cache:
        return "--enable-session-radix-cache (SGLang's Rust core has no sessions)"
    if tuple(params.tree_components or ()) != (_FULL,):
        return "a hybrid model's states (the mirror follows full-attention KV only)"
    if params.eviction_policy != "vamp":
        return f"--radix-eviction-policy {params.eviction_policy} (the mirror keeps VAMP's order only)"
    if resolve_tree_core_backend("rust", dataclasses.replace(params, eviction_policy="lru")) != "rust":
        return "SGLang builds its Python tree core here (see its log line)"
    return None


class MirrorNode:
    """One node of the Rust core's tree as VAMP prices it. `key` is the key of the request that last placed the
    node and `start` the offset of its first token in that key (units of the key: tokens, or bigrams);
    `child_key` is its key in its parent's `children` (kept: an eviction removes it by that key)."""

    __slots__ = ("child_key", "children", "id", "key", "lock_ref", "parent", "priority", "start", "tokens",
                 "vamp_stats")
    backuped = False  # what the planner reads of a HiCache host copy: this core runs without a host tier

    def __init__(self, node_id: int, parent: MirrorNode | None, key: Any, start: int, tokens: int,
                 stats: NodeStats) -> None:
        self.id, self.parent, self.key, self.start, self.tokens = node_id, parent, key, start, tokens
        self.children: dict[Any, MirrorNode] = {}
        self.child_key: Any = None
        self.lock_ref, self.priority, self.vamp_stats = 0, 0, stats

    def __lt__(self, other: MirrorNode) -> bool:
        """Of two leaves of equal priority the older goes first (SGLang's Python nodes: the last accessed)."""
        return self.id < other.id


class VampRustTreeCore(VampStatistics, RustUnifiedTreeCore):
    """SGLang's Rust tree core with VAMP's p_eff eviction order, from a mirror of its tree (module docstring)."""

    def __init__(self, params: Any, order: CostOrder) -> None:
        if reason := refusal(params):
            raise ValueError(f"VAMP's order cannot run on SGLang's Rust tree core with {reason}: "
                             "use --vamp-tree-core python")
        self.init_statistics(order)  # vamp_restored_tokens stays 0: no host tier here for an insert to re-fill
        # the Rust core keeps a heap of its own that VAMP does not read: any built-in policy name builds it
        super().__init__(dataclasses.replace(params, eviction_policy="lru", eviction_policy_config=None))
        self.vamp_hybrid = False
        c = order.coefficients
        self.vamp_leaf_order = LeafOrder(c.alpha, c.tau_steps, _describe, ties_by_id=True)  # MirrorNode.__lt__
        self.vamp_mirror: dict[int, MirrorNode] = {}
        # tokens of the mirror's unlocked and locked nodes: the Rust core's full_evictable_size, full_protected_size
        self.vamp_evictable_tokens = self.vamp_protected_tokens = 0
        self.evictable_device_leaves = _WatchedLeaves(set(), self.vamp_leaf_order)
        self.vamp_evict_request_tokens = 0  # what the eviction SGLang runs now asked for
        self.vamp_victims: tuple[int, Any, list[MirrorNode]] | None = None  # (changes, priority key, nodes): hand_over
        self.vamp_insert: Any = None  # the InsertParams of the insert SGLang runs now (it may take several steps)
        self.vamp_lost: str | None = None  # why the mirror stopped following the Rust core (`_lose`); None: it follows
        self.vamp_evicting = False  # the eviction SGLang runs now is in VAMP's order (else the Rust core's own)

    # --- the mirror -------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        if hasattr(self, "vamp_mirror"):  # RustUnifiedTreeCore.__init__ does not reset; a later reset clears
            self.vamp_mirror.clear()
            self.evictable_device_leaves.clear()
            self.vamp_evictable_tokens = self.vamp_protected_tokens = 0
            self.vamp_changes += 1
            if self.vamp_lost is not None:  # both trees empty (SGLang's /flush_cache): the mirror follows again
                logger.warning("vamp: the tree was reset; VAMP's order runs it again (the mirror had stopped: %s)",
                               self.vamp_lost)
                self.vamp_lost = None

    def vamp_node(self, node_id: int) -> MirrorNode:
        return self.vamp_mirror[node_id]

    def node_tokens(self, node: MirrorNode) -> int:
        return node.tokens

    def device_nodes(self) -> list[MirrorNode]:
        return [n for n in self.vamp_mirror.values() if n.parent is not None]

    def set_hicache_enabled(self) -> None:
        raise ValueError("VAMP's order on SGLang's Rust tree core has no host tier: HiCache needs "
                         "--vamp-tree-core python")

    def unlocked_device_values(self) -> list[tuple[int, Any]]:
        """(id, KV indices) of every node no request holds: compaction.py moves their rows in the Rust core's tensor."""
        self._mirror(self._check_counts)  # a lock it missed would hand a running request's rows over; lost: none
        return [(n.id, self.get_component_device_value(n.id, _FULL)) for n in self.vamp_mirror.values()
                if n.parent is not None and not n.lock_ref]

    def _root(self, root_id: int) -> MirrorNode:
        root = self.vamp_mirror.get(root_id)
        if root is None:
            root = self.vamp_mirror[root_id] = MirrorNode(root_id, None, None, 0, 0, NodeStats(0))
        return root

    def _follow(self, key: Any, node_id: int, touch: bool) -> None:
        """File the nodes on the path to `node_id` the mirror does not know yet (`key` reaches it); `touch`: an
        insert walked the path, so every node on it (and a suffix split off it) was used now."""
        now = self.now_steps()
        if self.is_eagle and not key.is_bigram:  # EAGLE: matched by tokens, inserted and split by bigrams
            key = RadixKey(key.token_ids, key.extra_key, is_bigram=True, limit=key.limit, cache_salt=key.cache_salt)
        if node_id not in self.vamp_mirror:
            page, path = self.page_size, self.collect_path_info([node_id])[0]
            if not path:  # a root (one per key namespace)
                self._root(node_id)
            for info in path:
                if info.node_id in self.vamp_mirror:
                    continue
                parent = self.vamp_mirror.get(info.parent_id) or self._root(info.parent_id)
                child_key = key.child_key_at(info.path_start, page)
                node = MirrorNode(info.node_id, parent, key, info.path_start, info.full_value_len or 0,
                                  NodeStats(now, prior=self.vamp_write_prior))
                moved = parent.children.get(child_key)
                if moved is not None:  # a split: the old id keeps the suffix, one level down
                    if moved.tokens <= node.tokens:
                        raise RuntimeError(f"node {info.node_id} splits node {moved.id} of {moved.tokens} tokens at "
                                           f"{node.tokens}")
                    if touch:
                        moved.vamp_stats.touch(now)
                    node.vamp_stats, node.lock_ref, node.priority = moved.vamp_stats.copy(), moved.lock_ref, moved.priority
                    moved.start += info.path_end - info.path_start
                    moved.tokens -= node.tokens
                    moved.parent = node
                    moved.child_key = moved.key.child_key_at(moved.start, page)
                    node.children[moved.child_key] = moved
                    self.vamp_priorities.pop(moved.id, None)
                    self._refile(moved)  # its touch moved its key: the kept order's bound for it must not lag
                else:
                    self.evictable_device_leaves.discard(parent)
                    self.vamp_evictable_tokens += node.tokens  # a new node, unlocked (a split keeps the sums)
                parent.children[child_key] = node
                node.child_key = child_key
                self.vamp_mirror[node.id] = node
                self._refile(node)
        if touch:
            node = self.vamp_mirror[node_id]
            leaf = node
            while node.parent is not None:
                node.vamp_stats.touch(now)
                self.vamp_priorities.pop(node.id, None)
                node = node.parent
            self._refile(leaf)

    def _refile(self, node: MirrorNode) -> None:
        """Put `node` in the evictable leaves (re-filed at its statistics) or take it out; every change ends here."""
        self.vamp_changes += 1
        if self._is_leaf(node):
            self.evictable_device_leaves.add(node)
        else:
            self.evictable_device_leaves.discard(node)

    @staticmethod
    def _is_leaf(node: MirrorNode) -> bool:
        """An evictable leaf: not a root, no child, no lock."""
        return node.parent is not None and not node.children and not node.lock_ref

    def _lock_path(self, node_id: int | None, delta: int) -> None:
        node = self.vamp_mirror.get(node_id) if node_id is not None else None
        anchor = node
        while node is not None and node.parent is not None:
            if not node.lock_ref or node.lock_ref + delta == 0:  # it turns locked or unlocked
                self.vamp_evictable_tokens -= delta * node.tokens
                self.vamp_protected_tokens += delta * node.tokens
            node.lock_ref += delta
            node = node.parent
        if anchor is not None:
            self._refile(anchor)

    def _lose(self, error: Exception) -> None:
        """The mirror failed to follow (a defect of ours) and cannot be rebuilt: the Rust core's LRU evicts until a
        reset, decisions fall back to SGLang's eviction (`eviction_candidates` raises); logged once, in /vamp/stats."""
        self.vamp_lost = f"{type(error).__name__}: {error}"
        logger.error("vamp: the mirror of SGLang's Rust tree stopped following it (%s); SGLang's own eviction "
                     "order (LRU) runs this tree from now on", self.vamp_lost, exc_info=error)
        self.vamp_mirror.clear()
        self.evictable_device_leaves.clear()
        self.vamp_victims, self.vamp_evictable_tokens, self.vamp_protected_tokens = None, 0, 0

    def _check_counts(self) -> None:
        """Before the mirror names nodes (victims, rows to move): a node it missed or a lock it did not count."""
        held = (self.vamp_evictable_tokens, self.vamp_protected_tokens)
        if held != (rust := (self.full_evictable_size(), self.full_protected_size())):
            raise RuntimeError(f"the mirror holds {held} (evictable, protected) tokens, the Rust core {rust}")

    def _mirror(self, update: Any, *args: Any) -> None:
        """`update(*args)` of the mirror unless it is lost; an error loses it (`_lose`), not SGLang's call."""
        if self.vamp_lost is None:
            try:
                update(*args)
            except Exception as error:  # noqa: BLE001
                self._lose(error)

    # --- SGLang's tree operations, followed ------------------------------------------------------
    def match_prefix(self, params: Any) -> Any:
        result = super().match_prefix(params)
        if result.last_device_node not in self.vamp_mirror:
            self._mirror(self._follow, params.key, result.last_device_node, False)
        return result

    def begin_insert(self, params: Any) -> Any:
        self.vamp_insert = params
        return self._followed_insert(super().begin_insert(params))

    def resume_insert(self) -> Any:
        return self._followed_insert(super().resume_insert())

    def _followed_insert(self, step: Any) -> Any:
        if step.result is not None and step.result.last_device_node is not None:
            self._mirror(self._follow_insert, step.result.last_device_node, step.result.rotation_tail_declined)
        return step

    def _follow_insert(self, node_id: int, declined: bool) -> None:
        """The insert's result followed: its path, touched, and its priority (none if declined: it used nothing)."""
        self._follow(self.vamp_insert.key, node_id, touch=not declined)
        if (priority := self.vamp_insert.priority) and not declined:  # kept per node: the highest written through it
            node = leaf = self.vamp_mirror[node_id]
            while node.parent is not None:  # the touch just dropped these nodes' memoised priorities
                node.priority = max(node.priority, priority)
                node = node.parent
            self._refile(leaf)

    def inc_lock_ref(self, node_id: Any, skip_lock_components: Any = ()) -> Any:
        result = super().inc_lock_ref(node_id, skip_lock_components)
        self._mirror(self._lock_path, node_id, 1)
        return result

    def dec_lock_ref(self, node_id: Any, params: Any, skip_swa: bool = False) -> Any:
        result = super().dec_lock_ref(node_id, params, skip_swa)
        self._mirror(self._lock_path, node_id, -1)
        return result

    def record_admission(self, node_id: int, hit_tokens: int, requested_tokens: int, first: bool) -> None:
        if self.vamp_lost is None:
            try:
                return super().record_admission(node_id, hit_tokens, requested_tokens, first)
            except Exception as error:  # noqa: BLE001 - admission is SGLang's; the hit-rate ledger still counts it
                self._lose(error)
        if first:
            self.vamp_ledger.record(hit_tokens, requested_tokens)

    # --- eviction in VAMP's order -----------------------------------------------------------------
    def hand_over(self, nodes: list[MirrorNode]) -> None:
        """A decision's walk took `nodes`: the next eviction takes them without walking, unless anything changed."""
        self.vamp_victims = (self.vamp_changes, self.vamp_priority_key, nodes)

    def evict_device_start(self, component_type: ComponentType, request_cnt: int) -> None:
        self.vamp_evict_request_tokens, self.vamp_evicting = request_cnt, self.vamp_lost is None
        if not self.vamp_evicting:
            return super().evict_device_start(component_type, request_cnt)
        victims, self.vamp_victims = self.vamp_victims, None
        try:
            self._check_counts()
            self.priced_now()  # the step and published priors, as a walk would price them
            if victims is not None and victims[:2] == (self.vamp_changes, self.vamp_priority_key):
                self.vamp_walk = _HandedOver(self, victims[2])
            else:
                self.vamp_walk = self.vamp_ordered_walk(self.evictable_device_leaves.__contains__)
        except Exception as error:  # noqa: BLE001 - the next call hands this eviction to the Rust core's own order
            self._lose(error)

    def evict_device_next_node(self, component_type: ComponentType, tracker: dict) -> EvictDeviceNextNodeResult:
        if self.vamp_evicting and self.vamp_lost is not None:  # lost within this eviction: the Rust core finishes it
            self._close_walk()
            self.vamp_evicting = False
            super().evict_device_start(component_type, self.vamp_evict_request_tokens)
        if not self.vamp_evicting:
            return super().evict_device_next_node(component_type, tracker)
        if tracker[_FULL] >= self.vamp_evict_request_tokens:
            return EvictDeviceNextNodeResult()
        try:
            node = next(self.vamp_walk, None)
        except Exception as error:  # noqa: BLE001 - the walk failed: the Rust core finishes this eviction
            self._lose(error)
            return self.evict_device_next_node(component_type, tracker)
        if node is None:
            return EvictDeviceNextNodeResult()
        return EvictDeviceNextNodeResult(node_id=node.id, made_progress=True)

    def evict_device_end(self, component_type: ComponentType) -> None:
        if self.vamp_evicting:
            self._close_walk()
        else:
            super().evict_device_end(component_type)

    def _close_walk(self) -> None:
        if self.vamp_walk is not None:
            self.vamp_walk.close()
        self.vamp_walk = None

    def evict_device_leaf(self, node_id: Any, is_write_back: bool) -> Any:
        result = super().evict_device_leaf(node_id, is_write_back)
        self._mirror(self._evicted, node_id, result.tracker.get(_FULL, 0))  # lost: the Rust core's order goes on
        return result

    def _evicted(self, node_id: int, freed_tokens: int) -> None:
        node = self.vamp_mirror.pop(node_id)
        if freed_tokens != node.tokens:
            raise RuntimeError(f"the Rust core freed {freed_tokens} tokens of node {node_id}, the mirror held {node.tokens}")
        self.evictable_device_leaves.discard(node)
        self.vamp_evictable_tokens -= node.tokens
        self.vamp_priorities.pop(node_id, None)
        parent = node.parent
        del parent.children[node.child_key]
        if type(self.vamp_walk) is _HandedOver:
            self.vamp_walk.freed(parent)
        else:
            self._refile(parent)  # a parent left without children joins the open walk at its key

    def vamp_priority(self, node: MirrorNode) -> tuple:
        return self.priced_now()(node)


class _HandedOver:
    """A decision's nodes (each still an evictable leaf), then a walk of the kept order. A parent it frees joins the
    leaf set at once, the kept order when the walk starts or the eviction ends: filing them cost a third per victim."""

    def __init__(self, core: VampRustTreeCore, nodes: list[MirrorNode]) -> None:
        self.core, self.nodes, self.walk = core, iter(nodes), None
        self.unfiled: list[MirrorNode] = []  # parents freed, in the leaf set, not yet in the kept order

    def freed(self, parent: MirrorNode) -> None:
        """`parent` lost its last child to this eviction: filed at once once the walk runs, else deferred."""
        core = self.core
        if self.walk is not None:
            core._refile(parent)
            return
        core.vamp_changes += 1
        if core._is_leaf(parent):
            core.evictable_device_leaves.add_unfiled(parent)
            self.unfiled.append(parent)

    def file(self) -> None:
        leaves, order = self.core.evictable_device_leaves, self.core.vamp_leaf_order
        for node in self.unfiled:
            if node in leaves:
                order.add(node)
        self.unfiled = []

    def __iter__(self) -> _HandedOver:
        return self

    def __next__(self) -> MirrorNode:
        core = self.core
        if self.walk is None:
            node = next(self.nodes, None)
            if node is not None and node in core.evictable_device_leaves:
                return node
            self.nodes = iter(())  # the decision's walk ended, or (never seen) its node is no leaf: walk instead
            self.file()
            self.walk = core.vamp_ordered_walk(core.evictable_device_leaves.__contains__)
        return next(self.walk)

    def close(self) -> None:
        self.file()
        if self.walk is not None:
            self.walk.close()
        elif not self.core.vamp_leaf_order.open_walks:  # as a walk closing does: the next decision's walk does not
            self.core.vamp_leaf_order.drop_dead_tops()   # pay for the victims' dead heap entries
