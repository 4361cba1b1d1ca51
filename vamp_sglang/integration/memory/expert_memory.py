"""Expert memory becomes KV memory inside one SGLang scheduler process (paper IV-C, IV-D, V-A, V-B).

`ExpertMemory` is the API the decision layer calls (`headroom_groups`, `tokens_for`, `offload`,
`restorable_groups`, `restore`, and `pool_sizes` before a round, `return_to` them to undo a round
another rank refused); each remap is a transaction of the memory layer's `Repartitioner`
whose last step publishes the new pool size to SGLang (allocator free list and every size copy), so
a failure anywhere leaves SGLang, the KV rows and the expert bytes as they were.

With a speculative draft (EAGLE, EAGLE3, NEXTN) every draft KV pool grows and shrinks with the target's, in
the same transaction and to the same size (`draft_pools`): its pages come from the same groups.

On a hybrid model the linear-attention state pool grows from the same groups (`slots_for`,
`offload_state`; `state_pool`): a state-slot shortfall offloads to it, and a restore takes the KV
pool's groups back first, then the state pool's.

The hooks in `expert_memory_hooks.py` build it in the scheduler process, and with
`--vamp-max-offload-ratio 0` never do.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vamp_sglang.faults import NONE, Faults
from vamp_sglang.integration.memory import kv_pool
from vamp_sglang.integration.memory.draft_pools import buffer_set, draft_stats
from vamp_sglang.integration.memory.kv_pool import GrowablePool
from vamp_sglang.integration.memory.state_pool import GrowableStatePool
from vamp_sglang.integration.staging import moe_staging
from vamp_sglang.integration.staging.moe_staging import ModelExperts
from vamp_sglang.memory.kv_buffers import KVShrinkError
from vamp_sglang.memory.repartition import Repartitioner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSizes:
    """Where the groups are and how large SGLang's pools are: what an undone round returns to exactly."""

    kv_groups: int
    state_groups: int
    kv_tokens: int
    state_slots: int  # 0 without a state pool


class ExpertMemory:
    """One scheduler's expert-to-KV repartitioning, in KV tokens and expert groups per eligible layer."""

    def __init__(self, experts: ModelExperts, pool: GrowablePool, allocator: Any,
                 publish: Callable[[], dict[str, int]], quiesce: Callable[[], None],
                 states: GrowableStatePool | None = None, tree_cache: Any = None,
                 draft_pools: Sequence[GrowablePool] = ()) -> None:
        """`publish()` refreshes SGLang's copies of the pool size after the allocator changed and returns
        them; `quiesce()` waits until no forward can touch the pages about to move. `states` is a hybrid
        model's state pool, whose cached states in `tree_cache` a restore may move. `draft_pools` are the
        speculative draft's KV pools over the same allocator's ids (integration/memory/draft_pools.py)."""
        kv_pool.check_allocator(allocator, pool)
        self.experts, self.pool, self.allocator = experts, pool, allocator
        self.draft_pools = list(draft_pools)
        self.states, self.tree_cache = states, tree_cache
        self._state_target: int | None = None  # the state pool size the running remap publishes
        self._slots_at_start = 0  # the state pool size when the running remap began (what a rollback restores)
        self._publish, self._quiesce = publish, quiesce
        self.layout = experts.layout
        self.faults: Faults = NONE  # VAMP_SGLANG_FAULT=remap:P makes the transaction fail here
        self.remap_s = 0.0
        self.size_snapshots: dict[str, int] = {}
        self.repartitioner = Repartitioner(
            self.layout, experts.stores, buffer_set(pool, self.draft_pools), self._on_pool_resize,
            tail_is_free=self._tail_is_free,
            staging=experts.engine, state=states.buffers if states else None,
            on_state_resize=self._on_state_resize if states else None, residency=experts.residency)

    # ---- the API the decision layer uses ---------------------------------------------------------

    @property
    def offloaded_groups(self) -> int:
        return self.repartitioner.offloaded_groups

    @property
    def pool_tokens(self) -> int:
        return int(self.allocator.size)

    def headroom_groups(self) -> int:
        """Groups per eligible layer that may still be offloaded (offload bound, paper IV-C)."""
        return self.layout.bound_groups - self.offloaded_groups

    def tokens_for(self, n_groups: int) -> int:
        """KV tokens this rank gains by offloading `n_groups` more groups per eligible layer (read-only)."""
        self._check_groups("n_groups", n_groups, self.headroom_groups())
        return self._max_tokens_at(self.repartitioner.kv_groups + n_groups) - self.pool_tokens

    def slots_for(self, n_groups: int) -> int:
        """State slots offloading `n_groups` more groups to the state pool adds (read-only; 0 without one)."""
        self._check_groups("n_groups", n_groups, self.headroom_groups())
        if self.states is None:
            return 0
        return self.repartitioner.state_rows_at(self.repartitioner.state_groups + n_groups) - 1 - self.states.slots

    def offload_state(self, n_groups: int, slots: int) -> None:
        """Transaction: offload `n_groups` groups from every eligible layer into the state pool and grow
        it by exactly `slots` (<= slots_for(n_groups), as the ranks agreed); or raise and change nothing."""
        gain = self.slots_for(n_groups)
        if self.states is None or not isinstance(slots, int) or not 0 <= slots <= gain or (n_groups == 0 and slots):
            raise ValueError(f"slots must be an integer in [0, slots_for({n_groups}) = {gain}] (got {slots!r})")
        if n_groups:
            self._state_target = self.states.slots + slots
            try:
                self._remap(lambda: self.repartitioner.offload(n_groups, to_state=True))
            finally:
                self._state_target = None

    def offload(self, n_groups: int, tokens: int) -> None:
        """Transaction: offload `n_groups` groups from every eligible layer and grow the pool by exactly
        `tokens` (the amount the ranks agreed on, <= tokens_for(n_groups)); or raise and change nothing."""
        gain = self.tokens_for(n_groups)
        if not isinstance(tokens, int) or not 0 <= tokens <= gain or (n_groups == 0 and tokens):
            raise ValueError(f"tokens must be an integer in [0, tokens_for({n_groups}) = {gain}] (got {tokens!r})")
        if n_groups:
            self._remap(lambda: self.repartitioner.offload(n_groups, pool_tokens=self.pool_tokens + tokens))

    def restorable_groups(self) -> int:
        """Groups that can come back now: the KV tail ids they would take are all free, and the state
        slots past the smaller state pool are free or hold cached states that can move below it."""
        free_from = kv_pool.free_tail_start(self.allocator)
        kv_groups = self.repartitioner.kv_groups
        n = 0
        while n < kv_groups and self.size_after_restore(n + 1) >= free_from:
            n += 1
        if n < kv_groups or self.states is None:
            return n
        while n < self.offloaded_groups and self._state_tail_movable(self._slots_after_restore(n + 1)):
            n += 1
        return n

    def restore(self, n_groups: int) -> int:
        """Transaction: bring `n_groups` groups back into every eligible layer; returns the KV tokens
        the pool lost. Refused (KVShrinkError, nothing changed) unless the dropped tail ids are free."""
        self._check_groups("n_groups", n_groups, self.offloaded_groups)
        if n_groups == 0:
            return 0
        old, new = self.pool_tokens, self.size_after_restore(n_groups)
        from_state = max(n_groups - self.repartitioner.kv_groups, 0)
        if from_state:
            self.states.compact(self.tree_cache, self._slots_after_restore(n_groups))
        self._remap(lambda: self.repartitioner.restore(n_groups, pool_tokens=new))
        return old - new

    @property
    def sglang_pools(self) -> list[Any]:
        """SGLang's KV pools whose rows one token id names: the target's, then each draft's."""
        return [self.pool.pool, *(d.pool for d in self.draft_pools)]

    def pool_sizes(self) -> PoolSizes:
        return PoolSizes(self.repartitioner.kv_groups, self.repartitioner.state_groups, self.pool_tokens,
                         self.states.slots if self.states is not None else 0)

    def return_to(self, sizes: PoolSizes) -> None:
        """Transactions back to exactly `sizes` (`pool_sizes()` before a round another rank refused): the
        groups the round moved go back to the pools they came from, and each pool takes the size it had,
        not the largest its groups allow. A retry after a failure goes on from where that one stopped.
        Only the ranks that applied the round run these, so no transaction here may hold a collective."""
        with self.repartitioner.undoing():
            self._return_to(sizes)

    def _return_to(self, sizes: PoolSizes) -> None:
        rep = self.repartitioner
        extra_state, extra_kv = rep.state_groups - sizes.state_groups, rep.kv_groups - sizes.kv_groups
        if extra_state > 0:
            self._state_target = sizes.state_slots
            try:
                self._remap(lambda: rep.restore(extra_state, pool_tokens=self.pool_tokens, state_first=True))
            finally:
                self._state_target = None
        if extra_kv > 0:
            self._remap(lambda: rep.restore(extra_kv, pool_tokens=sizes.kv_tokens))
        if extra_kv < 0:
            self.offload(-extra_kv, sizes.kv_tokens - self.pool_tokens)
        if extra_state < 0:
            self.offload_state(-extra_state, sizes.state_slots - self.states.slots)
        if self.pool_sizes() != sizes:
            raise KVShrinkError(f"could not return to {sizes}: the pools are at {self.pool_sizes()}")

    def state_restore_view(self, n_groups: int) -> tuple[int, int, int]:
        """(state slots in use, the state pool size once `n_groups` are back, cached states the tree could
        evict): what a restore plan needs of the state pool; zeros without one."""
        if self.states is None:
            return 0, 0, 0
        used = self.states.slots - int(self.states.allocator.available_size())
        return used, self._slots_after_restore(n_groups), int(self.tree_cache.mamba_evictable_size())

    def stats(self) -> dict[str, Any]:
        lay, rep = self.layout, self.repartitioner.stats()
        staging = self.experts.engine.served_stats()  # served traffic: without SGLang's warm-up request
        return {
            "experts": {"eligible_layers": rep.eligible_layers, "groups_per_layer": rep.groups_per_layer,
                        "shards_per_group": rep.group_experts, "offloaded_groups": rep.offloaded_groups,
                        "max_groups": rep.bound_groups, "offload_ratio": rep.offload_ratio,
                        "reclaimed_bytes": rep.reclaimed_bytes, "spare_bytes": rep.spare_bytes,
                        "remap_s": round(self.remap_s, 6), "page_backend": self.experts.backend.name,
                        "live_pages": dataclasses.asdict(self.experts.backend.live_counts()),
                        "remap_gib_per_s": round(rep.remap_gib_per_s, 3),
                        "graph_breaks": moe_staging.staging_breaks(self.experts)},
            "kv_pool": {"max_tokens": self._max_tokens_at(lay.bound_groups), "groups": self.repartitioner.kv_groups,
                        "buffer_rows": self.pool.kv.row_capacity, "size_snapshots": dict(self.size_snapshots)},
            "staging": {"wait_s": round(staging.wait_s, 6), "copy_s": round(staging.copy_s, 6),
                        "step_wait_s": round(staging.step_wait_s, 6), "step_copy_s": round(staging.step_copy_s, 6),
                        "bytes": staging.bytes_staged, "copies": staging.copies, "stalls": staging.stalls,
                        "steps": staging.steps, "pinned_bytes": self.experts.staging_buffers.pinned_bytes,
                        "policy": self.experts.engine.chooser.policy,
                        "modes": {mode: {k: round(v, 6) for k, v in totals.items()}
                                  for mode, totals in staging.by_mode.items()},
                        "split_w2_wait": self.experts.engine.split_w2_wait,
                        "missed_w2_waits": self.experts.engine.missed_w2_waits},
            "residency": self.experts.residency.stats() if self.experts.residency else {"order": "index"},
            **({"host_experts": self.experts.host.as_dict()} if self.experts.host is not None else {}),
            **({"draft_pools": draft_stats(self.draft_pools)} if self.draft_pools else {}),
            **({"state_pool": {**self.states.stats(), "groups": rep.state_groups,
                               "max_slots": self.repartitioner.state_rows_at(lay.bound_groups) - 1}}
               if self.states is not None else {}),
        }

    # ---- inside a transaction --------------------------------------------------------------------

    def _remap(self, move: Callable[[], int]) -> None:
        self._quiesce()
        self._slots_at_start = self.states.slots if self.states is not None else 0
        start = time.perf_counter()
        try:
            move()
        finally:
            self.remap_s += time.perf_counter() - start

    def _on_pool_resize(self, old_rows: int, new_rows: int, pool_tokens: int | None) -> None:
        """The transaction's last step: SGLang sees the new size `pool_tokens`, which offload/restore
        handed down (raising here rolls the remap back)."""
        self.faults.check("remap", "the pool resize of a remap transaction")
        if pool_tokens is None:
            raise ValueError("ExpertMemory remaps always name the SGLang pool size they publish")
        new, old = pool_tokens, self.pool_tokens
        if new > self.pool.size_for_rows(new_rows):
            raise KVShrinkError(f"pool size {new} does not fit the {new_rows} mapped rows")
        try:
            self._resize_sglang(old, new)
            self.faults.check("publish", "the end of a remap transaction, after SGLang saw the new pool size")
        except BaseException:
            self._resize_sglang(self.pool_tokens, old, zero_new_rows=False)  # then the pages move back
            raise

    def _resize_sglang(self, old: int, new: int, zero_new_rows: bool = True) -> None:
        if new < old:
            kv_pool.shrink_allocator(self.allocator, new)  # checks the dropped ids are free first
        for pool in (self.pool, *self.draft_pools):
            pool.resize(new, zero_new_rows)
        if new > old:
            kv_pool.grow_allocator(self.allocator, new)
        self.size_snapshots = self._publish()

    def _on_state_resize(self, old_rows: int, new_rows: int, rollback: bool) -> None:
        """A state remap's publish step: SGLang's state pool takes the size the remap names (an offload's
        agreed size, an undo's size before the round), else the size the mapped rows allow; a rollback
        gives it back the size it had when the remap began. Raising here rolls the remap back, after
        SGLang's pool is as before; a rollback itself is never fault-injected."""
        if rollback:
            self.states.resize(self._slots_at_start)
            return
        self.faults.check("remap", "the state pool resize of a remap transaction")
        target = new_rows - 1 if self._state_target is None else min(self._state_target, new_rows - 1)
        try:
            self.states.resize(target)
            self.faults.check("publish", "the end of a state remap, after SGLang saw the new state pool size")
        except BaseException:
            self.states.resize(self._slots_at_start)  # then the pages move back
            raise

    def _slots_after_restore(self, n_groups: int) -> int:
        """The state pool size once `n_groups` groups are back (the KV pool's come back first)."""
        rep = self.repartitioner
        state_groups = rep.state_groups - max(n_groups - rep.kv_groups, 0)
        return min(self.states.slots, rep.state_rows_at(state_groups) - 1)

    def _state_tail_movable(self, keep_slots: int) -> bool:
        return self.states.free_tail_start() <= keep_slots or self.states.tail_is_movable(self.tree_cache, keep_slots)

    def _tail_is_free(self, first_row: int, end_row: int) -> bool:
        """Rows past the new buffer end may be dropped only if SGLang's ids there are free."""
        new_size = min(self.pool_tokens, self.pool.size_for_rows(first_row))
        return kv_pool.free_tail_start(self.allocator) <= new_size

    def size_after_restore(self, n_groups: int) -> int:
        """The KV pool size once `n_groups` groups are back, the KV pool's first (rows above it must be free)."""
        kv_groups = self.repartitioner.kv_groups
        return min(self.pool_tokens, self._max_tokens_at(kv_groups - min(n_groups, kv_groups)))

    def _max_tokens_at(self, kv_groups: int) -> int:
        return self.pool.size_for_rows(self.repartitioner.rows_at(kv_groups))

    @staticmethod
    def _check_groups(name: str, value: int, most: int) -> None:
        if not isinstance(value, int) or not 0 <= value <= most:
            raise ValueError(f"{name} must be an integer in [0, {most}] (got {value!r})")
