"""SGLang's radix tree with reuse statistics and p_eff-ordered eviction (`--radix-cache-backend vamp`).

SGLang 0.5.23 builds `UnifiedRadixCache` over a pluggable tree core; its default Rust core takes
only the eight built-in eviction policies by name, so `VampTreeCore` subclasses the Python core
(`UnifiedTreeCore`, the one SGLang itself uses for sessions and KV sharding) and adds per-node
`NodeStats`. Everything else stays SGLang's: the tree walk, locks, HiCache tiers, session refs and
paging. Registration goes through SGLang's own registries:

    --radix-cache-backend vamp      VampUnifiedRadixCache over VampTreeCore (stats, estimates)
    --radix-eviction-policy vamp    evict lowest p_eff first (Eq. 1, cache/ordering.py); needs the backend

Hits are counted at admission (the runtime's hook on `PrefillAdder._commit_prefill_admission` calls
`record_admission`), walking the locked `req.last_node` to the root (never at match: waiting requests
are re-matched every round). We do not reuse SGLang's insert-time `hit_count`: it drives HiCache's
write-through threshold (changing it would change HiCache), write-back mode skips it, and only
admission sees, in one place, the matched prefix AND the prompt length, which give the request's
hit rate: the tree-wide rate of Eq. 1 (the runtime's one `AdmissionLedger`, which the tree reads)
and the prior of the nodes this request then writes (`checkpoint_into_tree`, `NodeStats.prior`).

Hybrid models (a MAMBA component: Qwen3-Next's linear-attention state) follow SGLang's reuse rule
(cache/hybrid.py): a match ends at the deepest node holding a state, so a stateless leaf is evicted
first (priority below every p_eff) and costs nothing, and a leaf with a state is priced by every
token its eviction makes unreachable, its stateless ancestors included.

Every eviction prices each leaf once: priorities are memoised per node for the current step and
tree-wide hit rate (a node's own change drops its entry), so the planner's read-only walk and
SGLang's eviction heap that follows it share one computation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore, UnifiedTreeNode
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from vamp_sglang.cache import (
    AdmissionLedger,
    CostOrder,
    EvictionEstimate,
    HybridTree,
    NodeStats,
    estimate,
    eviction_order,
    pow2_histogram,
    tokens_losing_reuse,
)
from vamp_sglang.config import VampConfig
from vamp_sglang.policy.costs import Coefficients
from vamp_sglang.policy.planner import eviction_need_tokens
from vamp_sglang.policy.snapshot import EvictableBlock

NAME = "vamp"  # the backend, tree-core and eviction-policy name
_FULL = ComponentType.FULL
_MAMBA = ComponentType.MAMBA
DEAD_PRIORITY = -1.0  # below every p_eff: a hybrid node no match can end in goes first
HITS_HISTOGRAM_TOP = 64
AGE_HISTOGRAM_TOP_STEPS = 65536


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


class VampTreeCore(UnifiedTreeCore):
    """SGLang's Python tree core plus `node.vamp_stats` on every node and the admission ledger."""

    def __init__(self, params: Any, components: dict, order: CostOrder) -> None:
        # set before super().__init__: reset() already creates the root through _new_node
        self.vamp_order = order
        self.vamp_step_fn: Callable[[], int] = lambda: 0
        self.vamp_ledger = AdmissionLedger()  # replaced by the runtime's ledger once it exists
        self.vamp_priorities: dict[int, tuple] = {}  # node id -> priority, valid for vamp_priority_key
        self.vamp_priority_key: tuple[int, float] | None = None  # (step, tree-wide hit rate)
        self.vamp_evicted_tokens = 0
        self.vamp_write_prior: float | None = None  # hit rate of the request inserting right now
        super().__init__(params, components)
        self.vamp_hybrid = _MAMBA in self.components_by_type  # linear-attention states in the tree
        if isinstance(self.eviction_strategy, VampStrategy):
            self.eviction_strategy.bind(self.vamp_priority)

    def now_steps(self) -> int:
        return int(self.vamp_step_fn())

    # --- statistics kept through SGLang's own node life cycle ------------------------------------
    def _new_node(self, priority: int = 0) -> UnifiedTreeNode:
        node = super()._new_node(priority)
        node.vamp_stats = NodeStats(self.now_steps(), prior=self.vamp_write_prior)
        return node

    @contextmanager
    def written_by(self, prior: float | None) -> Iterator[None]:
        """Nodes created inside inherit `prior`, the writing request's prefix-hit rate (NodeStats)."""
        self.vamp_write_prior = prior
        try:
            yield
        finally:
            self.vamp_write_prior = None

    def _split_node(self, key: Any, child: UnifiedTreeNode, split_len: int) -> tuple:
        new_node, action = super()._split_node(key, child, split_len)
        new_node.vamp_stats = child.vamp_stats.copy()
        return new_node, action

    def _touch_node(self, node: UnifiedTreeNode) -> None:
        super()._touch_node(node)  # insert walks touch every node they write through
        node.vamp_stats.touch(self.now_steps())
        self.vamp_priorities.pop(node.id, None)

    def record_admission(self, node_id: int, hit_tokens: int, requested_tokens: int, first: bool) -> None:
        """A request was admitted with its prefix matched up to `node_id` (locked by SGLang just now);
        `first`: its first admission (a retracted request's return or a later chunk is no new hit)."""
        now = self.now_steps()
        node = self.node_by_id(node_id)
        while node is not None and node is not self.root_node:
            node.vamp_stats.admit(now, count_hit=first)
            self.vamp_priorities.pop(node.id, None)
            node = node.parent
        if first:
            self.vamp_ledger.record(hit_tokens, requested_tokens)

    # --- cost view --------------------------------------------------------------------------------
    def node_tokens(self, node: UnifiedTreeNode) -> int:
        return self.components_by_type[_FULL].reclaimable_value_len(node)

    def has_state(self, node: UnifiedTreeNode) -> bool:
        """A hybrid node holds a linear-attention state checkpoint (on device) at its end."""
        return node.component_data[_MAMBA].value is not None

    def vamp_priority(self, node: UnifiedTreeNode) -> tuple:
        if self.vamp_hybrid and not self.has_state(node):  # states come and go outside our memo
            return (DEAD_PRIORITY, node.vamp_stats.last_step, node.vamp_stats.created_step)
        key = (self.now_steps(), self.vamp_ledger.hit_rate)
        if key != self.vamp_priority_key:
            self.vamp_priorities.clear()
            self.vamp_priority_key = key
        priority = self.vamp_priorities.get(node.id)
        if priority is None:
            priority = self.vamp_priorities[node.id] = self.vamp_order.priority(node.vamp_stats, *key)
        return priority

    def prior_hit_rate(self, node: UnifiedTreeNode) -> float:
        """The r_hit prior this node is priced with: its writer's rate, else the tree-wide rate."""
        prior = node.vamp_stats.prior
        return self.vamp_ledger.hit_rate if prior is None else prior

    def cost_of_losing_s(self, node: UnifiedTreeNode, lost_tokens: int) -> float:
        """C_c (Eq. 2) of `node` when its eviction makes `lost_tokens` unreachable (0: nothing lost)."""
        if not lost_tokens:
            return 0.0
        return self.vamp_order.cost_s(lost_tokens, node.vamp_stats, self.now_steps(), self.vamp_ledger.hit_rate)

    def device_nodes(self) -> list[UnifiedTreeNode]:
        return [n for n in self._node_arena.values() if n is not self.root_node and not n.evicted]


class VampUnifiedRadixCache(UnifiedRadixCache):
    """SGLang's unified cache over `VampTreeCore`: tags what a request writes, counts what is evicted."""

    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        # SGLang's one path from a request into the tree (after prefill chunks, at finish, at retraction)
        with self.tree_core.written_by(getattr(req, "vamp_prior", None)):
            super().checkpoint_into_tree(req, up_to=up_to, **kwargs)

    def update_eviction_metrics(self, num_evicted: int, start_time: float) -> None:
        self.tree_core.vamp_evicted_tokens += num_evicted
        super().update_eviction_metrics(num_evicted, start_time)


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
        full = core.components_by_type[_FULL]
        # the same key FullComponent heaps by: session refs first when sessions are on
        self.priority = full.session_ref_eviction_strategy or core.eviction_strategy.get_priority

    def evictable_leaves(self) -> set[UnifiedTreeNode]:
        return self.core.evictable_device_leaves

    def tokens(self, node: UnifiedTreeNode) -> int:
        return self.core.node_tokens(node)

    def parent_if_leaf_after(self, node: UnifiedTreeNode, removed: set) -> UnifiedTreeNode | None:
        """Mirrors `UnifiedTreeCore._is_device_leaf` with `removed` treated as evicted."""
        parent = node.parent
        if parent is None or parent is self.core.root_node or parent.evicted:
            return None
        if any(cd.lock_ref > 0 for cd in parent.component_data):
            return None
        if any(c not in removed and c.component_data[_FULL].value is not None for c in parent.children.values()):
            return None
        return parent


# --- public API ------------------------------------------------------------------------------------
def tree_core_of(tree_cache: Any) -> VampTreeCore:
    core = getattr(tree_cache, "tree_core", None)
    if not isinstance(core, VampTreeCore):
        raise TypeError(f"expected a tree built with --radix-cache-backend vamp, got {type(tree_cache).__name__} "
                        f"with core {type(core).__name__}")
    return core


def bind_step_source(tree_cache: Any, step_fn: Callable[[], int]) -> None:
    """Ages are measured with `step_fn` (the scheduler's `forward_ct`) from now on."""
    tree_core_of(tree_cache).vamp_step_fn = step_fn


def set_coefficients(tree_cache: Any, coefficients: Coefficients) -> None:
    """Re-price the tree (e.g. after calibrating t_prefill online); the next eviction uses them."""
    core = tree_core_of(tree_cache)
    core.vamp_order = CostOrder(coefficients)
    core.vamp_priority_key = None


def eviction_candidates(tree_cache: Any, gap_tokens: int, free_tokens: int, running_requests: int,
                        retract_buffer_tokens: int) -> list[EvictableBlock]:
    """Nodes in the order the tree would evict them, taken lazily until they cover the most any plan
    may ask the tree for (`eviction_need_tokens`), each with the prior the tree prices it with."""
    core = tree_core_of(tree_cache)
    need = eviction_need_tokens(gap_tokens, free_tokens, running_requests, retract_buffer_tokens)
    now, out, covered, lost = core.now_steps(), [], 0, LostTokens(core)
    for node in eviction_order(_DeviceTreeView(core)):
        if covered >= need:
            break
        tokens = core.node_tokens(node)
        covered += tokens
        out.append(EvictableBlock(tokens, node.vamp_stats.hits, node.vamp_stats.age_steps(now),
                                  core.prior_hit_rate(node), lost(node) if core.vamp_hybrid else None))
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
    return estimate(_DeviceTreeView(core), n_tokens, lambda node: core.cost_of_losing_s(node, lost(node)))


def estimate_eviction(tree_cache: Any, n_tokens: int) -> tuple[int, float]:
    """(tokens freed, summed C_c in seconds) if the tree were asked to free `n_tokens` now; read-only."""
    result = eviction_plan(tree_cache, n_tokens)
    return result.tokens, result.cost_s


def radix_stats(tree_cache: Any) -> dict[str, Any]:
    """The `/vamp/stats` radix section: sizes, reuse and eviction counts; never token ids or text."""
    core = tree_core_of(tree_cache)
    nodes, now, ledger = core.device_nodes(), core.now_steps(), core.vamp_ledger
    evictable, protected = int(core.full_evictable_size()), int(core.full_protected_size())
    return {
        "node_count": len(nodes),
        "cached_tokens": evictable + protected,
        "evictable_tokens": evictable,
        "protected_tokens": protected,
        "admissions": ledger.admissions,
        "hit_tokens": ledger.hit_tokens,
        "requested_tokens": ledger.requested_tokens,
        "hit_rate": ledger.hit_rate,
        "hits_histogram": pow2_histogram((n.vamp_stats.hits for n in nodes), HITS_HISTOGRAM_TOP),
        "age_histogram_steps": pow2_histogram((n.vamp_stats.age_steps(now) for n in nodes),
                                              AGE_HISTOGRAM_TOP_STEPS),
        "evicted_tokens": core.vamp_evicted_tokens,
    }


class RadixStatsExtension:
    """Merged into the runtime's `/vamp/stats` snapshot (`VampRuntime.extensions`)."""

    def __init__(self, tree_cache: Any) -> None:
        self.tree_cache = tree_cache

    def stats(self) -> dict[str, Any]:
        return {"radix": radix_stats(self.tree_cache)}


def record_admission(tree_cache: Any, req: Any, hit_tokens: int, requested_tokens: int, first: bool) -> None:
    """Node hits, recency and the hit-rate ledger for one admitted request; the nodes it writes
    inherit its hit rate."""
    core = tree_core_of(tree_cache)
    core.record_admission(req.last_node, hit_tokens, requested_tokens, first)
    if first and requested_tokens:
        req.vamp_prior = hit_tokens / requested_tokens


def setup_scheduler(scheduler: Any, runtime: Any) -> None:
    """Per scheduler process, once the tree exists: step source, the runtime's one hit-rate ledger,
    stats section, start-up checks."""
    from sglang.srt.runtime_context import get_memory

    tree_cache = scheduler.tree_cache
    if not isinstance(getattr(tree_cache, "tree_core", None), VampTreeCore):
        if get_memory().radix_eviction_policy == NAME:
            raise RuntimeError("--radix-eviction-policy vamp needs --radix-cache-backend vamp "
                               f"(this scheduler built {type(tree_cache).__name__})")
        return
    bind_step_source(tree_cache, lambda: scheduler.forward_ct)
    tree_core_of(tree_cache).vamp_ledger = runtime.ledger
    runtime.vamp_tree = tree_cache
    runtime.extensions.append(RadixStatsExtension(tree_cache))


# --- registration ----------------------------------------------------------------------------------


def _build_cache(ctx: Any) -> VampUnifiedRadixCache:
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    ctx.params.tree_core_backend = NAME
    return create_unified_radix_cache(ctx, cache_class=VampUnifiedRadixCache)


def install() -> None:
    """Register backend, tree core and eviction policy with SGLang (idempotent).

    Runs in every SGLang process (the HTTP process needs the policy name to parse its flags; the
    scheduler needs the factories). Admissions reach the tree through the runtime's hook.
    """
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES, add_radix_eviction_policy_choices
    from sglang.srt.mem_cache import utils as mem_cache_utils
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        get_tree_core_factory,
        register_tree_core_backend,
    )

    order = CostOrder(Coefficients.from_config(VampConfig.from_env() or VampConfig()))
    if NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([NAME])
    mem_cache_utils._EVICTION_POLICY_FACTORIES[NAME] = VampStrategy  # no public API for this dict
    if get_tree_core_factory(NAME) is None:
        register_tree_core_backend(NAME, lambda params, components: VampTreeCore(params, components, order))
    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, _build_cache)
