"""The planner of paper section IV-B: cover an allocation gap with the lowest-cost feasible plan.

Four candidate plans are priced for every gap, whichever is chosen, so the decision log can show
why: offload (Eq. 3), evict (Eq. 2), preempt (Eqs. 4/5) and combined (Eq. 6). A plan is feasible
when it covers the whole gap; an infeasible one is priced as None. Each is priced as SGLang will
carry it out:

- offload: the smallest multiple of `expand_groups` groups whose exact token gain covers the gap,
  capped at the headroom and at the TPOT guard's cap (`--vamp-tpot-slo-ms`). No headroom, no
  offload (and no combined): "only C_c and C_p remain".
- evict: whole radix nodes in the tree's own eviction order, each at the tree's own price, until
  the gap is covered.
- preempt: only at a decode allocation (at a prefill allocation SGLang's admission has already
  promised the space). SGLang's `retract_decode` retracts victims one at a time; each frees its
  rows beyond the cache-protected prefix, and after each SGLang evicts until
  `retract_buffer_tokens` per remaining request are free, then re-checks the step's need. So C_p
  is the victims' C_p^(1) (Eqs. 4/5) plus C_c of that eviction, replayed here step by step.
- combined: the largest allowed offload that stays below the gap (a multiple of `expand_groups`,
  or all the headroom, as for offload), plus eviction of the remainder. It is None when that floor
  adds nothing (it would only be evict) and when the tree cannot free the remainder.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from vamp_sglang.config import POLICIES
from vamp_sglang.policy.costs import (
    Coefficients,
    cached_block_cost_s,
    combined_cost_s,
    dp_charged_groups,
    host_copy_block_cost_s,
    offload_cost_s,
    preempt_cost_s,
)
from vamp_sglang.policy.snapshot import EvictableBlock, Snapshot

COST_KEYS = ("evict", "offload", "preempt", "combined")
# "partial": nothing covers the gap; offload all headroom and evict everything evictable, and the
# rest stays short (at decode SGLang then retracts requests).
ACTIONS = ("none",) + COST_KEYS + ("partial",)
_TIE_ORDER = ("evict", "offload", "combined", "preempt")  # on equal cost: the least disruptive first


@dataclass(frozen=True)
class Plan:
    """What to do about one gap. `evict_tokens` is what to ask the tree to free (it frees whole
    nodes, so possibly a little more); a preempt plan leaves the gap short so SGLang retracts."""

    action: str
    groups: int
    evict_tokens: int
    costs: dict[str, float | None]  # keys COST_KEYS, seconds, None = infeasible

    @property
    def feasible(self) -> bool:
        return self.action != "partial"

    def to_json(self) -> dict[str, object]:
        return {"action": self.action, "groups": self.groups, "evict_tokens": self.evict_tokens,
                "costs": {key: self.costs[key] for key in COST_KEYS}}


@dataclass(frozen=True)
class _Option:
    cost_s: float
    groups: int
    evict_tokens: int


def plan(snapshot: Snapshot, coeffs: Coefficients, policy: str = "cost") -> Plan:
    """The plan for `snapshot` under `policy`; the snapshot's own coefficient overrides win over `coeffs`."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    c = snapshot.coefficients_over(coeffs)
    if snapshot.gap_tokens <= 0:
        zero = {key: 0.0 for key in COST_KEYS}
        if snapshot.site == "prefill":
            zero["preempt"] = None
        return Plan("none", 0, 0, zero)
    totals = _Totals(snapshot, c)
    options = {"evict": _evict(snapshot, totals), "offload": _offload(snapshot, c),
               "preempt": _preempt(snapshot, c, totals), "combined": _combined(snapshot, c, totals)}
    costs = {key: None if options[key] is None else options[key].cost_s for key in COST_KEYS}
    action = _CHOOSERS[policy](options)
    if action is None:
        return Plan("partial", snapshot.offloadable_groups,
                    sum(e.tokens for e in snapshot.evictable), costs)
    chosen = options[action]
    return Plan(action, chosen.groups, chosen.evict_tokens, costs)


def eviction_need_tokens(gap_tokens: int, free_tokens: int, running_requests: int,
                         retract_buffer_tokens: int) -> int:
    """The most tokens any plan may ask the tree to free: the gap, or what SGLang's retraction
    evicts after its first victim (a buffer per remaining request). The snapshot's candidate list
    may stop once it covers this much."""
    return max(gap_tokens, (running_requests - 1) * retract_buffer_tokens - free_tokens, 0)


# --- the four candidate plans --------------------------------------------------------------------
class _Totals:
    """Running totals (tokens freed, summed C_c) of evicting the snapshot's candidates in the tree's
    order, priced lazily and once per plan: evict, combined and the preempt replay all read the same
    prefix of the list. `freed[i]` and `cost_s[i]` cover the first i candidates, summed in order, so a
    total is the float a walk adding one block at a time gets."""

    def __init__(self, s: Snapshot, c: Coefficients) -> None:
        self.s, self.c = s, c
        self.freed, self.cost_s = [0], [0.0]

    def cover(self, need_tokens: int) -> int:
        """The fewest leading candidates that free `need_tokens` (all of them when none do)."""
        s, c, freed, cost_s = self.s, self.c, self.freed, self.cost_s
        priced = len(freed) - 1
        while freed[priced] < need_tokens and priced < len(s.evictable):
            e = s.evictable[priced]
            freed.append(freed[priced] + e.tokens)
            cost_s.append(cost_s[priced] + block_cost_s(s, e, c))
            priced += 1
        return min(bisect.bisect_left(freed, need_tokens), priced)  # freed grows: every block has tokens


class _TreeEviction:
    """Eviction from the snapshot's candidates in the tree's order, freeing whole nodes, resumable:
    the preempt replay evicts a little after each victim, the others once."""

    def __init__(self, totals: _Totals) -> None:
        self.totals = totals
        self.freed, self.cost_s = 0, 0.0

    def free(self, need_tokens: int) -> bool:
        """Evict until `need_tokens` are freed in all; False if the candidates run out first."""
        if self.freed < need_tokens:
            taken = self.totals.cover(need_tokens)
            self.freed, self.cost_s = self.totals.freed[taken], self.totals.cost_s[taken]
        return self.freed >= need_tokens


def block_cost_s(s: Snapshot, e: EvictableBlock, c: Coefficients) -> float:
    """C_c of evicting one candidate: Eq. 2, with the host load in place of the re-prefill when HiCache holds
    a copy and the load rate is known; a hybrid node no match can reach (no state below it) costs nothing."""
    if not e.lost_tokens:
        return 0.0
    if s.host_load_us_per_token is not None and (e.host_copy or s.host_write_back):
        load_s = s.host_load_us_per_token / 1e6
        write_s = 0.0 if e.host_copy else e.tokens * load_s  # write-back: the copy is written before the eviction
        return write_s + host_copy_block_cost_s(e.lost_tokens, e.hits, e.age_steps, e.prior_hit_rate, load_s, c)
    return cached_block_cost_s(e.lost_tokens, e.hits, e.age_steps, e.prior_hit_rate, c)


def _evict_cover(totals: _Totals, need_tokens: int) -> float | None:
    """C_c (Eq. 2) of freeing `need_tokens` from whole nodes taken in the tree's eviction order;
    None if the tree cannot free that much."""
    tree = _TreeEviction(totals)
    return tree.cost_s if tree.free(need_tokens) else None


def _evict(s: Snapshot, totals: _Totals) -> _Option | None:
    cost_s = _evict_cover(totals, s.gap_tokens)
    return None if cost_s is None else _Option(cost_s, 0, s.gap_tokens)


def _offload_price(s: Snapshot, c: Coefficients, groups: int) -> float:
    """Eq. 3 (spread over the accept length with a draft); under DP attention only the groups above the other DP
    ranks' offloads lengthen the step."""
    o, dp = s.offload, s.dp_step
    charged = groups if dp is None else dp_charged_groups(groups, dp.offloaded_groups, dp.peer_offloaded_groups)
    return offload_cost_s(charged, o.shards_per_group, o.local_experts, o.top_k, o.decode_budget_min, c,
                          o.accept_length)


def _allowed_groups(s: Snapshot, c: Coefficients) -> list[int]:
    """Offload sizes a plan may use: expand steps, and all the headroom (capped by the TPOT guard)
    as the last step."""
    most = s.offloadable_groups
    steps = list(range(c.expand_groups, most, c.expand_groups))
    return steps + [most] if most else []


def _offload(s: Snapshot, c: Coefficients) -> _Option | None:
    for groups in _allowed_groups(s, c):
        if s.offload_tokens(groups) >= s.gap_tokens:
            return _Option(_offload_price(s, c, groups), groups, 0)
    return None


def _preempt(s: Snapshot, c: Coefficients, totals: _Totals) -> _Option | None:
    """Replays `retract_decode`: retract a victim, evict to the per-request buffer, re-check."""
    if s.site == "prefill" or not s.preempt:
        return None
    free = s.free_tokens
    need = s.gap_tokens + s.free_tokens  # the step's allocation
    remaining = len(s.preempt) + 1  # SGLang keeps the last request
    tree, partials = _TreeEviction(totals), []
    for victim in s.preempt:
        remaining -= 1
        free += victim.tokens
        need -= victim.decode_tokens
        partials.append(victim.partial_tokens)
        target = max(remaining * s.retract_buffer_tokens, need)
        tree.free(target - free)  # SGLang evicts towards the target; the tree may run out
        if free + tree.freed >= need:
            return _Option(preempt_cost_s(partials, c) + tree.cost_s, 0, 0)
    return None


def _combined(s: Snapshot, c: Coefficients, totals: _Totals) -> _Option | None:
    below = [g for g in _allowed_groups(s, c) if s.offload_tokens(g) < s.gap_tokens]
    floor = below[-1] if below else 0
    added = s.offload_tokens(floor)
    if added == 0:
        return None
    remainder = s.gap_tokens - added
    evict_s = _evict_cover(totals, remainder)
    if evict_s is None:
        return None
    return _Option(combined_cost_s(_offload_price(s, c, floor), evict_s), floor, remainder)


# --- policies ------------------------------------------------------------------------------------
Options = dict[str, "_Option | None"]


def _cheapest(options: Options, keys: tuple[str, ...] = _TIE_ORDER) -> str | None:
    feasible = [(options[k].cost_s, _TIE_ORDER.index(k), k) for k in keys if options[k] is not None]
    return min(feasible)[2] if feasible else None


def _first_feasible(*steps: tuple[str, ...]) -> Callable[[Options], str | None]:
    """An ablation policy: take the first step with a feasible plan (cheapest within a step)."""
    def choose(options: Options) -> str | None:
        for keys in steps:
            if (action := _cheapest(options, keys)) is not None:
                return action
        return None
    return choose


_CHOOSERS: dict[str, Callable[[Options], str | None]] = {  # one per name in config.POLICIES
    "cost": _cheapest,
    "evict-first": _first_feasible(("evict",), ("offload",), ("combined", "preempt")),
    "offload-first": _first_feasible(("offload",), ("combined",), ("evict",), ("preempt",)),
}
