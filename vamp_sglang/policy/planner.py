"""The planner of paper section IV-B: cover an allocation gap with the lowest-cost feasible plan.

Four candidate plans are priced for every gap, whichever is chosen, so the decision log can show
why: offload (Eq. 3), evict (Eq. 2), preempt (Eqs. 4/5) and combined (Eq. 6). A plan is feasible
when it covers the whole gap; an infeasible one is priced as None.

- offload: the smallest multiple of `expand_groups` groups that covers the gap, capped at the
  headroom. No headroom, no offload (and no combined): "only C_c and C_p remain".
- evict: whole radix nodes in ascending C_c until the gap is covered.
- preempt: victims in SGLang's retraction order until the gap is covered; only at a decode
  allocation, because at a prefill allocation SGLang's admission has already promised the space.
- combined: the largest allowed offload that stays below the gap (a multiple of `expand_groups`,
  or all the headroom, as for offload), plus eviction of the remainder. It is None when that floor
  is zero (it would only be evict) and when the tree cannot free the remainder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vamp_sglang.policy.costs import (
    Coefficients,
    cached_block_cost_s,
    combined_cost_s,
    offload_cost_s,
    preempt_cost_s,
)
from vamp_sglang.policy.snapshot import Snapshot

COST_KEYS = ("evict", "offload", "preempt", "combined")
# "partial": nothing covers the gap; offload all headroom and evict everything evictable, and the
# rest stays short (at decode SGLang then retracts requests).
ACTIONS = ("none",) + COST_KEYS + ("partial",)
POLICIES = ("cost", "evict-first", "offload-first")
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
    options = {"evict": _evict(snapshot, c), "offload": _offload(snapshot, c),
               "preempt": _preempt(snapshot, c), "combined": _combined(snapshot, c)}
    costs = {key: None if options[key] is None else options[key].cost_s for key in COST_KEYS}
    action = _CHOOSERS[policy](options)
    if action is None:
        return Plan("partial", snapshot.offload.headroom_groups,
                    sum(e.tokens for e in snapshot.evictable), costs)
    chosen = options[action]
    return Plan(action, chosen.groups, chosen.evict_tokens, costs)


# --- the four candidate plans --------------------------------------------------------------------
def _evict_cover(s: Snapshot, c: Coefficients, need_tokens: int) -> float | None:
    """C_c (Eq. 2) of freeing `need_tokens` from whole nodes taken in the snapshot's order, which is
    the order the tree will really evict them in; None if the tree cannot free that much."""
    freed, cost_s = 0, 0.0
    for e in s.evictable:
        if freed >= need_tokens:
            break
        freed += e.tokens
        cost_s += cached_block_cost_s(e.tokens, e.hits, e.age_steps, s.observed_hit_rate, c)
    return cost_s if freed >= need_tokens else None


def _evict(s: Snapshot, c: Coefficients) -> _Option | None:
    cost_s = _evict_cover(s, c, s.gap_tokens)
    return None if cost_s is None else _Option(cost_s, 0, s.gap_tokens)


def _offload_price(s: Snapshot, c: Coefficients, groups: int) -> float:
    o = s.offload
    return offload_cost_s(groups, o.shards_per_group, o.local_experts, o.top_k, o.decode_budget_min, c)


def _offload(s: Snapshot, c: Coefficients) -> _Option | None:
    o = s.offload
    if o.headroom_groups == 0 or o.headroom_groups * o.tokens_per_group < s.gap_tokens:
        return None
    needed = -(-s.gap_tokens // o.tokens_per_group)
    groups = min(-(-needed // c.expand_groups) * c.expand_groups, o.headroom_groups)
    return _Option(_offload_price(s, c, groups), groups, 0)


def _preempt(s: Snapshot, c: Coefficients) -> _Option | None:
    if s.site == "prefill":
        return None
    freed, partials = 0, []
    for victim in s.preempt:
        if freed >= s.gap_tokens:
            break
        freed += victim.tokens
        partials.append(victim.partial_tokens)
    return _Option(preempt_cost_s(partials, c), 0, 0) if freed >= s.gap_tokens else None


def _combined(s: Snapshot, c: Coefficients) -> _Option | None:
    o = s.offload
    if o.headroom_groups == 0:
        return None
    below = -(-s.gap_tokens // o.tokens_per_group) - 1  # most groups that stay below the gap
    floor = o.headroom_groups if o.headroom_groups <= below else below // c.expand_groups * c.expand_groups
    if floor == 0:
        return None
    remainder = s.gap_tokens - floor * o.tokens_per_group
    evict_s = _evict_cover(s, c, remainder)
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


_CHOOSERS: dict[str, Callable[[Options], str | None]] = {
    "cost": _cheapest,
    "evict-first": _first_feasible(("evict",), ("offload",), ("combined", "preempt")),
    "offload-first": _first_feasible(("offload",), ("combined",), ("evict",), ("preempt",)),
}
