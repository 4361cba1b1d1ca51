"""What `/vamp/stats` counts as served traffic in the staging and host-expert figures (issue 49).

Two kinds of forwards are the server's own, not traffic it serves:
- SGLang's warm-up request: the HTTP server sends one once the scheduler runs (http_server.
  `_execute_server_warmup`, unless --skip-server-warmup) and reports itself up only after it. The
  scheduler cannot tell it from other requests, but it runs alone: the first time the scheduler is fully
  idle after a forward, everything counted so far (the warm-up's steps, and any forward before it) is
  excluded.
- health probes: `/health` and `/health_generate` run a one-token request whose rid starts with SGLang's
  HEALTH_CHECK_RID_PREFIX (http_server.health_generate); a forward whose every request is one is excluded.
On CUDA a probe's routed-copy bytes are read back after its forward, so they may stay counted. The
decisions' measurements (step_measurements.py) keep every forward: they difference the engine's cumulative
`stats()`, which this leaves alone (the engine reports `served_stats()`).
"""

from __future__ import annotations

from typing import Any


def health_probe(batch: Any) -> bool:
    """Whether every request of this ScheduleBatch is SGLang's health-check request."""
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    reqs = getattr(batch, "reqs", None) or []
    return bool(reqs) and all(str(req.rid).startswith(HEALTH_CHECK_RID_PREFIX) for req in reqs)


class ServedTraffic:
    """Excludes the warm-up and health probes from a ModelExperts' served figures."""

    def __init__(self, experts: Any, warmup: bool) -> None:
        self.experts = experts
        self._awaiting_warmup, self._forwards = warmup, 0
        self._before = experts.engine.stats()  # the engine's figures before the next forward
        self._host_before = self._host_counts()

    def after_forward(self, probe: bool) -> None:
        self._forwards += 1
        host = self.experts.host
        if probe:
            self.experts.engine.exclude_from_served(self._before)
            if host is not None:
                host.pairs, host.steps = self._host_before
        self._before, self._host_before = self.experts.engine.stats(), self._host_counts()

    def idle(self) -> None:
        """A fully idle scheduler: the first time after a forward, the warm-up is over."""
        if self._awaiting_warmup and self._forwards:
            self._awaiting_warmup = False
            self.experts.engine.exclude_from_served()
            if self.experts.host is not None:
                self.experts.host.pairs = self.experts.host.steps = 0
                self._host_before = (0, 0)

    def _host_counts(self) -> tuple[int, int]:
        host = self.experts.host
        return (host.pairs, host.steps) if host is not None else (0, 0)
