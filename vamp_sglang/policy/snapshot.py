"""The state at an allocation gap, as the planner sees it and as the decision log records it.

One JSON shape serves three readers: the integration builds it at SGLang's shortfall funnel, the
planner decides from it, and `python -m vamp_sglang.policy explain` replays it from a log line.
Validation lives in `Snapshot.__post_init__`, so a snapshot built in code is held to the same
rules as one parsed from a file, and every error names the offending field by its JSON path. It runs
at every shortfall, so it is cheap for what the integration builds: one pass over each list that only
accepts (exact ints, float rates, bools), and the field-by-field check, which names what is wrong,
only where that pass fails; the coefficient overrides, checked by building the VampConfig they make,
are remembered (`_overridden`), and so are those that passed (`_VALIDATED`).

    {"site": "prefill" | "decode", "gap_tokens": int, "free_tokens": int,
     "evictable": [{"tokens": int, "hits": int, "age_steps": int, "prior_hit_rate": float,
                    "reprefill_tokens": int, "host_copy": bool}, ...],  # both optional
     "offload": {"headroom_groups": int, "tokens_by_groups": [int, ...], "shards_per_group": int,
                 "local_experts": int, "top_k": int, "decode_budget_min": int,
                 "accept_length": float},                      # optional: a speculative draft (1.0 without)
     "preempt": [{"partial_tokens": int, "tokens": int, "decode_tokens": int}, ...],
     "retract_buffer_tokens": int,
     "observed_hit_rate": float,
     "tpot_guard_groups": int,                                 # optional: --vamp-tpot-slo-ms is on
     "host_load_us_per_token": float,                          # optional: HiCache on (rank-agreed)
     "host_write_back": bool,                                  # optional: HiCache's write-back policy
     "dp_step": {"offloaded_groups": int, "peer_offloaded_groups": int},  # optional: DP attention
     "coefficients": {VampConfig field name: value, ...}}      # optional overrides

`evictable` lists the radix tree's eviction candidates (whole nodes: evicting one frees all its
tokens) in the order the tree will evict them, each with the hit-rate prior the tree prices it
with (its writer's rate, or the tree-wide rate), so the planner prices what eviction really
removes, at the tree's own price. The list is cut once it covers the most any plan could ask for.
`reprefill_tokens` (hybrid models only) is what evicting the node makes no match reach any more
(cache/hybrid.py: a node without a linear-attention state below it is already dead, 0; a leaf's
stateless ancestors die with it); without it a node re-prefills its own `tokens`.
`tokens_by_groups[n - 1]` is the exact KV tokens offloading n more groups adds on every rank
(never an average: pages per buffer round down, so the first group can add 0).
`preempt` lists running requests in the order SGLang's `retract_decode` would retract them (the
last request is always kept): `tokens` is what retracting one frees at once (its rows beyond the
cache-protected prefix), `partial_tokens` what it must re-prefill when it returns, `decode_tokens`
what its next decode step would have allocated. After each retraction SGLang evicts until
`retract_buffer_tokens` per remaining request are free (`release_req`), which the planner prices.
`host_copy` (HiCache): the node has a valid host copy, so its eviction costs a later load of `tokens` at
`host_load_us_per_token` (the measured host-to-device rate, agreed over TP ranks) instead of a re-prefill
(costs.host_copy_block_cost_s). `host_write_back` (HiCache's write-back policy): evicting a node without a copy
writes one first, so it costs that write (its tokens at the same per-token rate) plus the host-copy price.
HiCache agrees its write-backs over the TP group, so ranks see the same copies.
`tpot_guard_groups` is the most groups the TPOT guard lets this decision offload (policy/tpot_guard).
`dp_step` (DP attention): the groups this DP rank has offloaded and the most any other DP rank had at the last
step (SGLang's MLP-sync all-gather); C_e is charged only for groups above the peers' (costs.dp_charged_groups).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vamp_sglang.policy.costs import COEFFICIENT_NAMES, Coefficients

SITES = ("prefill", "decode")


class SnapshotError(ValueError):
    """A snapshot that breaks the format; the message names the field by its JSON path."""


class EvictableBlock(NamedTuple):
    """One eviction candidate (a NamedTuple, not a frozen dataclass: a decision builds one per candidate, and a
    frozen dataclass takes three times as long to build)."""

    tokens: int
    hits: int  # admitted requests that reused this node
    age_steps: int  # scheduler steps since its last use
    prior_hit_rate: float  # r_hit prior of Eq. 1 the tree uses for this node (its writer class's observed reuse share)
    reprefill_tokens: int | None = None  # hybrid: tokens whose reuse its eviction ends (None: `tokens`)
    host_copy: bool = False  # HiCache holds a valid host copy: a later hit loads it instead of re-prefilling

    @property
    def lost_tokens(self) -> int:
        """The n_tok of Eq. 2: what a future request re-prefills because this node went."""
        return self.tokens if self.reprefill_tokens is None else self.reprefill_tokens


@dataclass(frozen=True)
class OffloadState:
    headroom_groups: int  # expert groups that may still be offloaded on every rank
    tokens_by_groups: tuple[int, ...]  # [n - 1]: KV tokens n more offloaded groups add (rank-agreed)
    shards_per_group: int  # g of Eq. 3
    local_experts: int  # E of Eq. 3: rank-local expert shards per layer
    top_k: int  # k of Eq. 3
    decode_budget_min: int  # smallest remaining decode budget among running requests (w before clamping)
    accept_length: float = 1.0  # speculative decoding: tokens a step commits (Eq. 3 spreads staging over them)


@dataclass(frozen=True)
class DpStep:
    offloaded_groups: int  # groups this DP rank has offloaded now
    peer_offloaded_groups: int  # the most any other DP rank had offloaded at the last step


@dataclass(frozen=True)
class PreemptCandidate:
    partial_tokens: int  # n_partial of Eq. 4: what it re-prefills when it comes back
    tokens: int  # rows retracting it frees at once (owned beyond the cache-protected prefix)
    decode_tokens: int  # rows its next decode step would allocate (one page, or none mid-page)


@dataclass(frozen=True)
class Snapshot:
    site: str
    gap_tokens: int  # tokens short of the allocation; <= 0 means nothing to do
    free_tokens: int  # tokens the allocator has free now
    evictable: tuple[EvictableBlock, ...]
    offload: OffloadState
    preempt: tuple[PreemptCandidate, ...]
    retract_buffer_tokens: int  # SGLang frees this many per remaining request after each retraction
    observed_hit_rate: float
    coefficients: Mapping[str, float | int] = field(default_factory=dict)
    tpot_guard_groups: int | None = None  # the TPOT guard's cap on groups to offload; None: no guard
    host_load_us_per_token: float | None = None  # HiCache: agreed host-to-device load time; None: no host tier
    host_write_back: bool = False  # HiCache's write-back policy: an eviction writes the host copy first
    dp_step: DpStep | None = None  # DP attention: offloads here and on the other DP ranks; None: no DP attention

    def __post_init__(self) -> None:
        object.__setattr__(self, "evictable", tuple(self.evictable))
        object.__setattr__(self, "preempt", tuple(self.preempt))
        if type(self.offload.tokens_by_groups) is not tuple:
            object.__setattr__(self, "offload", dataclasses.replace(
                self.offload, tokens_by_groups=tuple(self.offload.tokens_by_groups)))
        _validate(self)

    @property
    def offloadable_groups(self) -> int:
        """Headroom, capped by the TPOT guard when it is on."""
        headroom = self.offload.headroom_groups
        return headroom if self.tpot_guard_groups is None else min(headroom, self.tpot_guard_groups)

    def offload_tokens(self, n_groups: int) -> int:
        """KV tokens offloading `n_groups` more groups adds (0 for none)."""
        return self.offload.tokens_by_groups[n_groups - 1] if n_groups > 0 else 0

    def coefficients_over(self, base: Coefficients) -> Coefficients:
        """`base` with this snapshot's overrides applied, so a logged snapshot replays to the same plan."""
        return _overridden(base, self.coefficients) if self.coefficients else base

    @classmethod
    def from_json(cls, d: Any) -> Snapshot:
        top = _fields(d, "snapshot", _TOP_FIELDS, optional=("coefficients", "tpot_guard_groups",
                                                             "host_load_us_per_token", "host_write_back",
                                                             "dp_step"))
        offload = dict(_fields(top["offload"], "snapshot.offload", _names(OffloadState)[:-1],
                               optional=("accept_length",)))
        offload["tokens_by_groups"] = tuple(_list(offload["tokens_by_groups"], "snapshot.offload.tokens_by_groups"))
        return cls(
            site=top["site"],
            gap_tokens=top["gap_tokens"],
            free_tokens=top["free_tokens"],
            evictable=tuple(EvictableBlock(**_fields(e, f"snapshot.evictable[{i}]", _names(EvictableBlock)[:-2],
                                                     optional=("reprefill_tokens", "host_copy")))
                            for i, e in enumerate(_list(top["evictable"], "snapshot.evictable"))),
            offload=OffloadState(**offload),
            preempt=tuple(PreemptCandidate(**_fields(p, f"snapshot.preempt[{i}]", _names(PreemptCandidate)))
                          for i, p in enumerate(_list(top["preempt"], "snapshot.preempt"))),
            retract_buffer_tokens=top["retract_buffer_tokens"],
            observed_hit_rate=top["observed_hit_rate"],
            coefficients=dict(_fields(top.get("coefficients", {}), "snapshot.coefficients", (),
                                      optional=COEFFICIENT_NAMES)),
            tpot_guard_groups=top.get("tpot_guard_groups"),
            host_load_us_per_token=top.get("host_load_us_per_token"),
            host_write_back=top.get("host_write_back", False),
            dp_step=None if "dp_step" not in top else DpStep(**_fields(top["dp_step"], "snapshot.dp_step",
                                                                       _names(DpStep))),
        )

    def to_json(self) -> dict[str, Any]:
        offload = dataclasses.asdict(self.offload)
        offload["tokens_by_groups"] = list(self.offload.tokens_by_groups)
        if offload["accept_length"] == 1.0:
            del offload["accept_length"]  # no draft: the log line stays as it was
        d = {"site": self.site, "gap_tokens": self.gap_tokens, "free_tokens": self.free_tokens,
             "evictable": [{k: v for k, v in e._asdict().items()
                            if not (k == "reprefill_tokens" and v is None) and not (k == "host_copy" and not v)}
                           for e in self.evictable],
             "offload": offload,
             "preempt": [dataclasses.asdict(p) for p in self.preempt],
             "retract_buffer_tokens": self.retract_buffer_tokens,
             "observed_hit_rate": self.observed_hit_rate}
        if self.coefficients:
            d["coefficients"] = dict(self.coefficients)
        if self.tpot_guard_groups is not None:
            d["tpot_guard_groups"] = self.tpot_guard_groups
        if self.host_load_us_per_token is not None:
            d["host_load_us_per_token"] = self.host_load_us_per_token
        if self.host_write_back:
            d["host_write_back"] = True
        if self.dp_step is not None:
            d["dp_step"] = dataclasses.asdict(self.dp_step)
        return d


_TOP_FIELDS = ("site", "gap_tokens", "free_tokens", "evictable", "offload", "preempt", "retract_buffer_tokens",
               "observed_hit_rate")


def _names(cls: type) -> tuple[str, ...]:
    return cls._fields if issubclass(cls, tuple) else tuple(f.name for f in dataclasses.fields(cls))


def _fields(d: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise SnapshotError(f"{path} must be a JSON object (got {type(d).__name__})")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise SnapshotError(f"{path} has unknown field {unknown[0]!r}")
    missing = [name for name in required if name not in d]
    if missing:
        raise SnapshotError(f"{path}.{missing[0]} is missing")
    return d


def _list(v: Any, path: str) -> list[Any]:
    if not isinstance(v, list):
        raise SnapshotError(f"{path} must be a JSON list (got {type(v).__name__})")
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _int(v: Any, path: str, minimum: int | None) -> None:
    if not _is_int(v) or (minimum is not None and v < minimum):
        kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}[minimum]
        raise SnapshotError(f"{path} must be {kind} (got {v!r})")


def _validate(s: Snapshot) -> None:
    if s.site not in SITES:
        raise SnapshotError(f"snapshot.site must be 'prefill' or 'decode' (got {s.site!r})")
    _int(s.gap_tokens, "snapshot.gap_tokens", None)
    _int(s.free_tokens, "snapshot.free_tokens", 0)
    _int(s.retract_buffer_tokens, "snapshot.retract_buffer_tokens", 0)
    if not _plain_blocks(s.evictable):
        _validate_blocks(s.evictable)
    o = s.offload
    _int(o.headroom_groups, "snapshot.offload.headroom_groups", 0)
    if len(o.tokens_by_groups) != o.headroom_groups:
        raise SnapshotError(f"snapshot.offload.tokens_by_groups must list one count per headroom group "
                            f"({o.headroom_groups}, got {len(o.tokens_by_groups)})")
    if not _plain_gains(o.tokens_by_groups):
        _validate_gains(o.tokens_by_groups)
    # Without headroom the layout may be absent (offload off), so 0 is allowed there.
    _int(o.shards_per_group, "snapshot.offload.shards_per_group", 1 if o.headroom_groups > 0 else 0)
    _int(o.local_experts, "snapshot.offload.local_experts", 1)
    _int(o.top_k, "snapshot.offload.top_k", 1)
    _int(o.decode_budget_min, "snapshot.offload.decode_budget_min", 0)
    if not (_is_number(o.accept_length) and o.accept_length >= 1.0):
        raise SnapshotError(f"snapshot.offload.accept_length must be a number >= 1 (got {o.accept_length!r})")
    if not _plain_victims(s.preempt):
        _validate_victims(s.preempt)
    _rate(s.observed_hit_rate, "snapshot.observed_hit_rate")
    if s.tpot_guard_groups is not None:
        _int(s.tpot_guard_groups, "snapshot.tpot_guard_groups", 0)
    if s.host_load_us_per_token is not None and not (_is_number(s.host_load_us_per_token)
                                                     and s.host_load_us_per_token > 0):
        raise SnapshotError(f"snapshot.host_load_us_per_token must be a positive number "
                            f"(got {s.host_load_us_per_token!r})")
    if not isinstance(s.host_write_back, bool):
        raise SnapshotError(f"snapshot.host_write_back must be true or false (got {s.host_write_back!r})")
    if s.dp_step is not None:
        _int(s.dp_step.offloaded_groups, "snapshot.dp_step.offloaded_groups", 0)
        _int(s.dp_step.peer_offloaded_groups, "snapshot.dp_step.peer_offloaded_groups", 0)
    _validate_coefficients(s.coefficients)


def _plain_blocks(blocks: Sequence[EvictableBlock]) -> bool:
    """Every block valid and of the exact types the integration builds (a float rate): one pass,
    nothing formatted. False sends the list through `_validate_blocks`, which decides."""
    for e in blocks:
        lost = e.reprefill_tokens
        if not (type(e.tokens) is int and e.tokens >= 1 and type(e.hits) is int and e.hits >= 0
                and type(e.age_steps) is int and e.age_steps >= 0
                and type(e.prior_hit_rate) is float and 0.0 <= e.prior_hit_rate <= 1.0
                and type(e.host_copy) is bool and (lost is None or (type(lost) is int and lost >= 0))):
            return False
    return True


def _validate_blocks(blocks: Sequence[EvictableBlock]) -> None:
    for i, e in enumerate(blocks):
        _int(e.tokens, f"snapshot.evictable[{i}].tokens", 1)
        _int(e.hits, f"snapshot.evictable[{i}].hits", 0)
        _int(e.age_steps, f"snapshot.evictable[{i}].age_steps", 0)
        _rate(e.prior_hit_rate, f"snapshot.evictable[{i}].prior_hit_rate")
        if e.reprefill_tokens is not None:
            _int(e.reprefill_tokens, f"snapshot.evictable[{i}].reprefill_tokens", 0)
        if not isinstance(e.host_copy, bool):
            raise SnapshotError(f"snapshot.evictable[{i}].host_copy must be true or false (got {e.host_copy!r})")


def _plain_victims(victims: Sequence[PreemptCandidate]) -> bool:
    """Every candidate's counts exact non-negative ints, in one pass (else `_validate_victims` decides)."""
    return all(type(n) is int and n >= 0 for p in victims for n in (p.partial_tokens, p.tokens, p.decode_tokens))


def _validate_victims(victims: Sequence[PreemptCandidate]) -> None:
    for i, p in enumerate(victims):
        for name in ("partial_tokens", "tokens", "decode_tokens"):
            _int(getattr(p, name), f"snapshot.preempt[{i}].{name}", 0)


def _plain_gains(tokens_by_groups: tuple[int, ...]) -> bool:
    """Exact ints from 0 up, never decreasing: the check `_validate_gains` makes, in one pass."""
    previous = 0
    for tokens in tokens_by_groups:
        if type(tokens) is not int or tokens < previous:
            return False
        previous = tokens
    return True


def _validate_gains(tokens_by_groups: tuple[int, ...]) -> None:
    previous = 0
    for i, tokens in enumerate(tokens_by_groups):
        _int(tokens, f"snapshot.offload.tokens_by_groups[{i}]", 0)
        if tokens < previous:
            raise SnapshotError(f"snapshot.offload.tokens_by_groups must not decrease (index {i}: "
                                f"{tokens} < {previous})")
        previous = tokens


def _rate(v: Any, path: str) -> None:
    if not (_is_number(v) and 0.0 <= v <= 1.0):
        raise SnapshotError(f"{path} must be a number in [0, 1] (got {v!r})")


def _validate_coefficients(overrides: Mapping[str, Any]) -> None:
    key = _override_key(_DEFAULTS, overrides)
    if key in _VALIDATED:
        return  # these very values passed before
    for name, value in overrides.items():
        if name not in COEFFICIENT_NAMES:
            raise SnapshotError(f"snapshot.coefficients has unknown field {name!r}; "
                                f"expected one of {', '.join(COEFFICIENT_NAMES)}")
        if name == "expand_groups":
            _int(value, "snapshot.coefficients.expand_groups", 1)
        elif not _is_number(value):
            raise SnapshotError(f"snapshot.coefficients.{name} must be a finite number (got {value!r})")
    try:
        _overridden(_DEFAULTS, overrides)
    except ValueError as e:
        raise SnapshotError(f"snapshot.coefficients: {e}") from None
    if len(_VALIDATED) >= _OVERRIDDEN_MAX:
        _VALIDATED.clear()
    _VALIDATED.add(key)


_DEFAULTS = Coefficients()
_ALL_NAMES = frozenset(COEFFICIENT_NAMES)
_OVERRIDDEN: dict[tuple, Coefficients] = {}  # see _overridden
_VALIDATED: set[tuple] = set()  # keys (`_override_key`) of overrides that passed `_validate_coefficients`
_OVERRIDDEN_MAX = 64  # measured coefficients change every 256 steps at most; a full memo is simply emptied


def _overridden(base: Coefficients, overrides: Mapping[str, Any]) -> Coefficients:
    """`base.with_overrides(overrides)`, remembered: building and validating the VampConfig costs more
    than the rest of a plan, and consecutive shortfalls carry the same coefficients (`_override_key`; the
    integration's snapshots override them all, so their key leaves `base` out)."""
    key = _override_key(base, overrides)
    found = _OVERRIDDEN.get(key)
    if found is None:
        found = base.with_overrides(overrides)
        if len(_OVERRIDDEN) >= _OVERRIDDEN_MAX:
            _OVERRIDDEN.clear()
        _OVERRIDDEN[key] = found
    return found


def _override_key(base: Coefficients, overrides: Mapping[str, Any]) -> tuple:
    """What `base.with_overrides(overrides)` depends on: each value's repr (it tells 1 from 1.0 and 0.0 from
    -0.0 where equality would not), and `base` only when some coefficient is not overridden."""
    key = tuple((name, repr(value)) for name, value in overrides.items())
    return key if overrides.keys() >= _ALL_NAMES else key + (repr(base),)
