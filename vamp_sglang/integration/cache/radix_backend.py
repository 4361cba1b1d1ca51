"""How the VAMP radix tree (radix_tree.py) enters SGLang and the per-process runtime.

Registration goes through SGLang's own registries (`install`, run in every SGLang process):

    --radix-cache-backend vamp      VampUnifiedRadixCache over a tree core with VAMP's statistics (estimates)
    --radix-eviction-policy vamp    evict in the tree's order (Eq. 1 extended, cache/ordering.py); needs the backend
    --vamp-tree-core auto|python|rust
                                    which SGLang tree core holds the tree: `VampRustTreeCore` (its Rust core, VAMP's
                                    order kept beside it, radix_rust.py) where that core can follow the tree (auto's
                                    choice), else `VampTreeCore` (its Python core, radix_tree.py): HiCache, radix-native
                                    sessions, hybrid models' states, eviction policies other than vamp

Once a scheduler has built its tree, `setup_scheduler` binds it to that process: ages in the
scheduler's steps (`forward_ct`, the unit of Eq. 1's tau), the runtime's one hit-rate ledger (so
`/vamp/stats` and the planner read the same r_hit), and the `/vamp/stats` radix section. Admissions
reach the tree through the runtime's hook on `PrefillAdder._commit_prefill_admission`, which calls
`record_admission`: node hits and the ledger, and the request's hit rate as the prior of the nodes
it then writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.unified_cache.components import ComponentType

from vamp_sglang.cache import CostOrder, pow2_histogram
from vamp_sglang.config import VampConfig
from vamp_sglang.integration.cache.radix_tree import (
    VampStatistics,
    VampStrategy,
    VampTreeCore,
    VampUnifiedRadixCache,
    tree_core_of,
)
from vamp_sglang.policy.costs import Coefficients

logger = logging.getLogger(__name__)
NAME = "vamp"  # the backend, tree-core and eviction-policy name
RUST_NAME = "vamp-rust"  # the tree core with VAMP's order beside SGLang's Rust core (radix_rust.py)
_FULL = ComponentType.FULL
HITS_HISTOGRAM_TOP = 64
AGE_HISTOGRAM_TOP_STEPS = 65536


def bind_step_source(tree_cache: Any, step_fn: Callable[[], int]) -> None:
    """Ages are measured with `step_fn` (the scheduler's `forward_ct`) from now on."""
    tree_core_of(tree_cache).vamp_step_fn = step_fn


def radix_stats(tree_cache: Any) -> dict[str, Any]:
    """The `/vamp/stats` radix section: sizes, reuse and eviction counts; never token ids or text."""
    core = tree_core_of(tree_cache)
    nodes, now, ledger = core.device_nodes(), core.now_steps(), core.vamp_ledger
    evictable, protected = int(core.full_evictable_size()), int(core.full_protected_size())
    out = {
        "tree_core": "python" if isinstance(core, VampTreeCore) else "rust",  # SGLang's core under the statistics
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
        "reuse_by_writer_hit_rate": core.vamp_shares.snapshot(),  # the r_hit priors of Eq. 1, by writer class
    }
    if lost := getattr(core, "vamp_lost", None):  # the Rust core's mirror failed: SGLang's own order evicts
        out["mirror_lost"] = lost
    if getattr(core, "enable_session_radix_cache", False):  # what open sessions hold; the rest goes first
        out["open_session_tokens"] = sum(core.node_tokens(n) for n in nodes
                                         if n.component_data[_FULL].session_ref > 0)
    return out


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
    if not isinstance(getattr(tree_cache, "tree_core", None), VampStatistics):
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

    ctx.params.tree_core_backend = _tree_core_name(ctx, _config().tree_core)
    return create_unified_radix_cache(ctx, cache_class=VampUnifiedRadixCache)


def _config() -> VampConfig:
    return VampConfig.from_env() or VampConfig()


def _tree_core_name(ctx: Any, choice: str) -> str:
    """The tree core `--vamp-tree-core` names, where what SGLang adds after building it (a host tier) allows the
    Rust core; the Rust core's factory then checks the tree itself (`_tree_core`)."""
    from sglang.srt.runtime_context import get_disagg, get_memory

    if choice == "python":
        return NAME
    host_tier = [name for name, on in (
        ("--enable-hierarchical-cache", ctx.enable_hierarchical_cache),
        ("host-pool retraction", get_disagg().disaggregation_decode_retraction_backup == "host_pool"),
        ("an external cache linker", get_memory().enable_unified_cache_external_linker)) if on]
    if host_tier:
        if choice == "rust":
            raise ValueError(f"--vamp-tree-core rust has no host tier ({', '.join(host_tier)}): use auto or python")
        logger.info("VAMP's tree on SGLang's Python core: %s", ", ".join(host_tier))
        return NAME
    return RUST_NAME


def _tree_core(params: Any, components: dict, order: CostOrder, choice: str) -> VampStatistics:
    """`VampRustTreeCore` where the mirror can follow the tree, else (auto) `VampTreeCore`."""
    from vamp_sglang.integration.cache import radix_rust

    reason = radix_rust.refusal(params)
    if reason is None:
        return radix_rust.VampRustTreeCore(params, order)
    if choice == "rust":
        raise ValueError(f"--vamp-tree-core rust cannot carry VAMP's order with {reason}: use auto or python")
    logger.info("VAMP's tree on SGLang's Python core: %s", reason)
    return VampTreeCore(params, components, order)


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

    config = _config()
    order = CostOrder(Coefficients.from_config(config))
    if NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([NAME])
    mem_cache_utils._EVICTION_POLICY_FACTORIES[NAME] = VampStrategy  # no public API for this dict
    if get_tree_core_factory(NAME) is None:
        register_tree_core_backend(NAME, lambda params, components: VampTreeCore(params, components, order))
    if get_tree_core_factory(RUST_NAME) is None:
        register_tree_core_backend(RUST_NAME, lambda params, components: _tree_core(params, components, order,
                                                                                   config.tree_core))
    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, _build_cache)
