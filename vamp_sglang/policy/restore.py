"""When expert memory comes back (the paper leaves restoring out; we restore when pressure stays low).

A restore shrinks the KV pool from its tail by one expand step, which is allowed only over free
rows, and makes decode cheaper again (fewer offloaded experts to stage). Two triggers, both pure
functions of a `RestoreState` so every restore is logged and replayed like a shortfall plan:

- busy, calm: the pool has stayed calm (after giving one step back, a quarter of the start-up pool
  would still be free) for `restore_after_steps` scheduler steps. Cached rows in the tail are moved
  below the smaller pool (compaction); nothing is evicted.
- busy, over the TPOT SLO (`--vamp-tpot-slo-ms`): decode has stayed above it while offloaded.
- idle: no request at all for `IDLE_RESTORE_S` seconds of wall-clock time (never scheduler polls,
  which come every second with --sleep-on-idle and thousands of times a second without it).
Under DP attention the step waits for the DP rank that stages most (costs.dp_charged_groups), so a restore over
the SLO shortens it only on a rank that has offloaded at least as many groups as any other DP rank (on a tie
every rank at the top restores alike); a rank below that keeps its groups, as restoring them would give up
KV rows and buy no step time. Calm and idle restores are about memory, and stay per rank.
In the last two, the cached prefixes that do not fit the smaller pool are evicted cheapest first.
A restore goes ahead only if that and compaction free every row it drops (no running request may
hold a tail row), so no prefix is evicted for a restore that cannot happen. A busy restore also
leaves `reserve_tokens` free in the smaller pool: the running requests' decode reservations and a
chunked prefill's next chunk; without them the very next step would be a shortfall that offloads
the experts again (or retracts).

On a hybrid model a restore past the KV pool's groups shrinks the linear-attention state pool: the
cached states that do not fit the smaller state pool are evicted (SGLang's LRU order) under the same
rules, and the rest are moved below it (ExpertMemory.restore).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

IDLE_RESTORE_S = 10.0  # wall-clock seconds without any request before experts start coming back


@dataclass(frozen=True)
class RestoreState:
    idle: bool  # no request queued or running
    idle_s: float  # wall-clock seconds the server has been idle (rank-agreed minimum)
    calm_steps: int  # consecutive busy steps with the calm condition true
    tpot_over_slo: bool  # busy, and the TPOT guard saw decode steps stay above --vamp-tpot-slo-ms
    restore_after_steps: int  # --vamp-restore-after-steps; 0 disables restoring
    offloaded_groups: int
    expand_groups: int
    pool_tokens: int
    keep_tokens: int  # the pool size once one step of groups is back
    used_tokens: int  # rows in use (requests and the tree)
    evictable_tokens: int  # rows the tree could evict now
    baseline_tokens: int  # the start-up pool
    tail_free: bool  # every row above keep_tokens is free already
    can_compact: bool  # every used row above keep_tokens is an unlocked tree node's (page size 1)
    used_state_slots: int = 0  # hybrid models: state slots in use (requests and cached states)
    keep_state_slots: int = 0  # the state pool size once the step is back (= its size if it keeps it)
    evictable_states: int = 0  # cached states the tree could evict now
    reserve_tokens: int = 0  # rows the running batch needs free after a busy restore (decode, next chunk)
    peer_offloaded_groups: int | None = None  # DP attention: the most another DP rank had offloaded at the last step

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class RestorePlan:
    groups: int  # 0: no restore now
    evict_tokens: int  # cached tokens to evict first (idle only)
    compact: bool  # move tree-held tail rows below keep_tokens first
    reason: str
    evict_states: int = 0  # hybrid models: cached states to evict first (idle or over the SLO only)

    @property
    def action(self) -> str:
        return "restore" if self.groups else "none"

    def to_json(self) -> dict[str, object]:
        return {"action": self.action, **asdict(self)}


def decode_reserve_tokens(running_requests: int, retract_steps: int, draft_reserve: int = 0) -> int:
    """Rows the running requests' next decode steps need free: SGLang's retraction buffer of `retract_steps`
    tokens per request, and with speculative decoding the `draft_reserve` rows each request's next draft and
    verify take ahead of its accepted tokens (SGLang's `get_alloc_reserve_per_decode`, twice the draft tokens
    a step writes: mem_cache/allocation_sizing.py:64, eagle_utils.eagle_prepare_for_decode)."""
    return running_requests * (retract_steps + draft_reserve)


def calm(free_tokens: int, pool_tokens: int, keep_tokens: int, baseline_tokens: int) -> bool:
    """A busy step is calm if, after giving one step back, a quarter of the start-up pool stays free."""
    return free_tokens >= (pool_tokens - keep_tokens) + baseline_tokens // 4


def plan_restore(s: RestoreState) -> RestorePlan:
    groups = min(s.expand_groups, s.offloaded_groups)
    if not s.restore_after_steps or groups == 0:
        return RestorePlan(0, 0, False, "nothing offloaded or restoring disabled")
    if s.idle:
        if s.idle_s < IDLE_RESTORE_S:
            return RestorePlan(0, 0, False, f"idle for {s.idle_s:.1f} of {IDLE_RESTORE_S:.0f} s")
        why = f"idle for {s.idle_s:.1f} s"
    elif s.tpot_over_slo:
        if s.peer_offloaded_groups is not None and s.peer_offloaded_groups > s.offloaded_groups:
            return RestorePlan(0, 0, False, f"decode over the TPOT SLO, but another DP rank stages more "
                                            f"({s.peer_offloaded_groups} > {s.offloaded_groups} groups)")
        why = "decode over the TPOT SLO"
    elif s.calm_steps >= s.restore_after_steps:
        why = f"calm for {s.calm_steps} steps"
    else:
        return RestorePlan(0, 0, False, f"calm for {s.calm_steps} of {s.restore_after_steps} steps")
    fits_reserve = s.used_tokens + s.reserve_tokens <= s.keep_tokens
    if s.tail_free and fits_reserve:
        return RestorePlan(groups, 0, False, f"{why}, tail free")
    if not s.tail_free and not s.can_compact:
        return RestorePlan(0, 0, False, f"{why}, but running requests hold tail rows (or the pool is paged)")
    evict_tokens = max(s.used_tokens + s.reserve_tokens - s.keep_tokens, 0)
    evict_states = max(s.used_state_slots - s.keep_state_slots, 0)
    if evict_tokens > s.evictable_tokens or evict_states > s.evictable_states:
        return RestorePlan(0, 0, False, f"{why}, but the smaller pool cannot hold what must stay")
    if (evict_tokens or evict_states) and not (s.idle or s.tpot_over_slo):
        return RestorePlan(0, 0, False, f"{why}, but a calm restore never evicts")
    states = f", {evict_states} states" if evict_states else ""
    compact = "" if s.tail_free else ", compact"
    return RestorePlan(groups, evict_tokens, not s.tail_free, f"{why}: evict {evict_tokens}{states}{compact}",
                       evict_states)
