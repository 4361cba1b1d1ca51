"""The agreement rounds one rank's decision maker holds, on top of the RankController.

Every TP rank reaches the same decision points in the same order (SGLang's scheduling is
replicated), so each rank holds the same rounds with the same ids: round ids restart from the
replicated tick (tick * ROUNDS_PER_TICK, then one more per round). A rank whose control flow
strayed (a round skipped, or one held alone) holds other calls under the ids the others use for
the rest of that tick; every round carries its kind and purpose ("agree/idle", "remap/offload"),
so such a round fails on every rank that held it (the controller compares them) and the next tick
realigns the ids. A bare round count never realigned: every later round agreed 0, for good.
This adds what the decision layer needs around a bare round:
- `agree(value, fallback)`: the minimum over ranks, or `fallback` when a rank missed the round;
  after a miss no round is held for ROUND_BACKOFF_STEPS ticks of `step_fn` (every live rank saw the
  miss, so they back off alike), so a lost rank does not make every shortfall wait out time-outs;
  a caller that backs off on its own may hold its round during the back-off (`despite_backoff`), and
  a round every rank answered ends the back-off (every rank saw that too);
- `remap(proposal, apply, undo)`: agree on min(proposal), apply it everywhere, and undo unless every
  rank succeeded; the undo is retried and never fault-injected (it compensates, it is no new remap);
- `all_equal(value)`: whether every rank holds the same value (a fingerprint check); False, with
  no round, during the back-off, like `agree`;
- `VAMP_SGLANG_FAULT=agree-timeout:P`: this rank enters a round too late for it, as a stalled rank would.
On one rank every call answers at once with no socket traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vamp_sglang.controller.messages import is_purpose
from vamp_sglang.faults import NONE, Faults

logger = logging.getLogger(__name__)

UNDO_ATTEMPTS = 3  # a compensating remap is retried this often before this rank gives up remapping
ROUND_BACKOFF_STEPS = 256  # after a TP rank missed an agreement round, hold no rounds for this many ticks
LATE_ROUND_FACTOR = 2.5  # an injected agree-timeout enters the round this many time-outs late
ROUNDS_PER_TICK = 1000  # round ids of tick t start at t * 1000, so logs read "round 5000003" as tick 5000's 4th


class RankRounds:
    def __init__(self, controller: Any, step_fn: Callable[[], int], faults: Faults = NONE) -> None:
        self.controller = controller
        self.step_fn = step_fn  # a tick replicated on every rank (scheduler steps plus idle polls)
        self.faults = faults
        self.round_id = 0
        self.missed = 0  # rounds a rank missed
        self.undo_failures = 0  # remaps this rank could not undo: its pool differs from the others'
        self.blocked_until_step = 0

    @property
    def several(self) -> bool:
        return self.controller.world_size > 1

    @property
    def blocked(self) -> bool:
        return self.several and self.step_fn() < self.blocked_until_step

    def _agree_min(self, value: int, tag: str) -> tuple[int, int]:
        """Round ids restart from the tick, so ranks whose rounds strayed within a tick agree on the
        next tick's ids (the max keeps ids increasing should a tick hold over ROUNDS_PER_TICK)."""
        self.round_id = max(self.round_id + 1, self.step_fn() * ROUNDS_PER_TICK)
        if self.faults.fires("agree-timeout"):
            time.sleep(LATE_ROUND_FACTOR * self.controller.timeout_s)
        return self.round_id, self.controller.agree_min(self.round_id, value, tag)

    def agree(self, value: int, fallback: int = 0, despite_backoff: bool = False, purpose: str = "") -> int:
        """The minimum of `value` over ranks, or `fallback` when a rank missed the round (or held
        another call under its id) or rounds are held back after a miss. `despite_backoff`: hold the
        round anyway, for a caller whose rounds are already sparse (the idle check, at doubling poll
        counts): an idle server polls about once a second, so ROUND_BACKOFF_STEPS ticks of it are
        minutes. `purpose` names the call site (see `_tag`)."""
        tag = _tag("agree", purpose)
        if not self.several:
            return value
        if self.blocked and not despite_backoff:
            return fallback
        round_id, agreed = self._agree_min(value, tag)
        if not self.controller.all_ok(round_id, True):  # every rank voted yes: a rank was missing
            self.missed += 1
            self.blocked_until_step = self.step_fn() + ROUND_BACKOFF_STEPS
            logger.warning("vamp: a TP rank missed agreement round %d; no remaps for %d steps",
                           round_id, ROUND_BACKOFF_STEPS)
            return fallback
        self.blocked_until_step = 0  # every rank answered, and all saw the same outcome
        return agreed

    def all_equal(self, value: int, purpose: str = "", despite_backoff: bool = False) -> bool:
        """Whether every rank holds `value`: False too when a rank missed the round, and, without a
        round, during the back-off (with a rank lost, each check would wait out the time-outs)."""
        tag = _tag("equal", purpose)
        if not self.several:
            return True
        if self.blocked and not despite_backoff:
            return False
        round_id, lowest = self._agree_min(value, tag)
        return self.controller.all_ok(round_id, lowest == value)

    def remap(self, proposal: int, apply: Callable[[int], Any], undo: Callable[[], Any], purpose: str = "") -> int:
        """Agree on min(proposal), `apply` it on every rank, `undo` unless all ok. Returns the amount
        every rank now holds (0: nothing changed anywhere)."""
        tag = _tag("remap", purpose)
        if self.blocked:
            return 0
        round_id, common = self._agree_min(proposal, tag) if self.several else (0, proposal)
        ok, applied = True, False
        if common > 0:
            try:
                apply(common)
                applied = True
            except Exception:  # the transaction left this rank as before; the vote tells the others
                logger.exception("vamp: remap round %d failed on this rank; no rank keeps it", round_id)
                ok = False
        if self.several and not self.controller.all_ok(round_id, ok):
            if applied:
                self._undo(round_id, undo)
            return 0
        return common if ok else 0

    def _undo(self, round_id: int, undo: Callable[[], Any]) -> None:
        """Roll back a remap another rank refused; retried, since ranks must end with equal pools."""
        for attempt in range(1, UNDO_ATTEMPTS + 1):
            try:
                with self.faults.paused():
                    undo()
                return
            except Exception:
                logger.exception("vamp: undoing remap round %d failed (attempt %d of %d)", round_id, attempt,
                                 UNDO_ATTEMPTS)
        self.undo_failures += 1
        logger.error("vamp: remap round %d could not be undone on this rank: its pool now differs from the "
                     "other ranks'; no further offloads here", round_id)


def _tag(kind: str, purpose: str) -> str:
    """The controller's purpose tag: the kind keeps a remap round from ever matching an agree or
    all_equal round, whatever purposes the callers chose. Checked on one rank too, so a bad name
    fails in single-rank tests rather than on a TP deployment."""
    tag = f"{kind}/{purpose}" if purpose else kind
    if "/" in purpose or not is_purpose(tag):
        raise ValueError(f"purpose must be a short call-site name [a-z0-9_.-] (got {purpose!r:.40})")
    return tag
