"""Fault injection for tests and soak runs: `VAMP_SGLANG_FAULT=remap:P[,publish:P][,agree-timeout:P]`.

A shortfall must never take the server down, whatever fails underneath it. To show that on a real
server, three faults can be switched on, each firing with probability P in [0, 1] per event:

- `remap:P`: each remap (offload or restore) raises inside its transaction, after the pages moved
  and just before SGLang would see the new pool size, so the whole rollback path runs;
- `publish:P`: each remap raises at its very end, after SGLang saw the new size and the new KV rows or
  state slots were zeroed (on pages just taken from the experts), so the rollback also takes the
  size back from SGLang and copies those experts back from the host;
- `agree-timeout:P`: this rank enters an agreement round too late for it (past the leader's and
  the followers' time-outs), as a stalled or lost rank would; the round then decides "no remap".

The variable is read once, when the launcher validates its flags (a malformed value stops the
launch with a message before anything loads) and once per scheduler process at start.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

KINDS = ("remap", "publish", "agree-timeout")


class FaultSpecError(ValueError):
    """A malformed VAMP_SGLANG_FAULT value; the message says what is wrong."""


class InjectedFault(RuntimeError):
    """Raised where a fault was injected; never raised unless VAMP_SGLANG_FAULT asks for it."""


@dataclass
class Faults:
    """Probabilities by kind; `fires(kind)` draws once per event."""

    probability: dict[str, float] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    fired: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in KINDS})
    _paused: int = 0

    @classmethod
    def parse(cls, spec: str | None, seed: int | None = None) -> Faults:
        """`kind:P` items separated by commas; empty or None means no faults."""
        probability: dict[str, float] = {}
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            kind, sep, value = item.partition(":")
            if kind not in KINDS or not sep:
                raise FaultSpecError(f"VAMP_SGLANG_FAULT item {item!r} must be KIND:P with KIND one of "
                                     f"{', '.join(KINDS)}")
            try:
                p = float(value)
            except ValueError:
                raise FaultSpecError(f"VAMP_SGLANG_FAULT item {item!r}: P must be a number in [0, 1]") from None
            if not 0.0 <= p <= 1.0:
                raise FaultSpecError(f"VAMP_SGLANG_FAULT item {item!r}: P must be in [0, 1] (got {p!r})")
            if kind in probability:
                raise FaultSpecError(f"VAMP_SGLANG_FAULT names {kind!r} twice")
            probability[kind] = p
        return cls(probability, random.Random(seed))

    @property
    def active(self) -> bool:
        return any(p > 0 for p in self.probability.values())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No fault fires inside: a compensating remap (undoing a remap another rank refused) is
        not a new remap, and injecting there would only test a double failure."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def fires(self, kind: str) -> bool:
        if self._paused:
            return False
        p = self.probability.get(kind, 0.0)
        hit = p > 0 and (p >= 1.0 or self.rng.random() < p)
        if hit:
            self.fired[kind] += 1
        return hit

    def check(self, kind: str, where: str) -> None:
        """Raise InjectedFault at `where` if a `kind` fault fires now."""
        if self.fires(kind):
            raise InjectedFault(f"injected {kind} fault at {where} (VAMP_SGLANG_FAULT)")


NONE = Faults()
