"""Per-step choice between whole-region prefetch, routed-only staging and host-computed cold experts
(issues 12, 49).

Whole (paper IV-D, V-B): each eligible layer's whole offloaded region is copied one MoE layer ahead, so
only the part of the copy that outlasts the overlap window is paid: max(0, B_whole / bw - window).
Routed-only: after the router, just the selected offloaded rows are copied, not overlapped, so all of it
is paid: rows(T) * row_bytes / bw_routed, with rows(T) = n_off * (1-(1-k/E)^T) scaled by the observed
ratio of distinct routed rows to that expectation (routing is not uniform). The cheaper one per layer
runs for the whole step; the window grows with the step's token count T, so it is measured per
power-of-two bucket of T, in whole steps, and whole is re-measured every `explore_every_steps` steps of
a bucket. Every input is measured online: bandwidths from the copies' own clocks, the window as copy
time minus exposed wait (a copy that never stalled had a window at least as long as itself).

On the host the model misses one cost: the whole-region copy runs on the second core while the compute
thread works, and the two share the memory bus, so a copy that never stalls the compute still slows it.
There (`measure_steps`) measured step times (forward start to the last eligible layer's MoE, the part
staging touches) decide, compared like with like (issue 19 item 12): per token, and only where a bucket
switches mode, the new mode's first step against the other mode's run just before it (its recent steps
smoothed), at most `pair_within_steps` steps apart. A mode's steady run never re-decides against the
other's old sample, whose load may be gone. Each bucket tries routed once after whole, then the faster
one runs; every `explore_every_steps` steps of the bucket the other one runs once next to it. On CUDA the
copy engines do not take the SMs, host clocks do not time the device, and the model alone decides.

Host-computed cold experts (issue 49, `host`, where the eligible layers can compute them: `host_capable`):
nothing is staged; the token-expert pairs routed to offloaded rows are computed from the host copies. Its
cost per layer is the expected pairs, T x k x the observed share of top-k slots that land on offloaded rows
(uniform at first: offloaded rows / E), times the measured seconds per pair of that token bucket (pairs of
a prefill step share their expert's weight reads, so a pair costs less there than in decode). Every input
is measured online like the others: a bucket without a host measurement, or whose last is
`explore_every_steps` old, runs host once. So a decode step with a few tokens per expert computes them on
the host while a prefill step, whose many pairs outcost copying their experts, stages them. Under
`measure_steps` the three modes' measured step times decide as above: the fastest of the modes measured
within `pair_within_steps` of a switch runs while every mode was measured within `explore_every_steps`;
then the least recently measured one runs once next to it. So in a server today host steps are chosen by
measured step times alone: on CUDA `auto` does not offer host (its two breaks per layer are laid only under
`--vamp-staging host`, integration/staging/host_experts_cuda.py, which has not run on a GPU), and the modelled
host price above decides only where steps are not measured and host is offered, a combination no server runs yet.

A layer whose router hands its MoE kernel no expert ids (SGLang's BYPASSED top-k format: FlashInfer TRT-LLM
routes from the logits inside its kernel) cannot stage routed: in a routed step it would copy its whole region
at the last moment, unprefetched, while the model above kept pricing the step as routed. Once any eligible
layer is seen without ids (at graph capture, or the first eager forward), every step is whole.
"""

from __future__ import annotations

import logging

from vamp_sglang.memory.routed import expected_routed_fraction
from vamp_sglang.policy.calibration import smooth

logger = logging.getLogger(__name__)

STAGING_POLICIES = ("auto", "whole", "routed", "host")
WHOLE, ROUTED, HOST = "whole", "routed", "host"


def token_bucket(tokens: int) -> int:
    """Steps whose token counts share a power of two share a measured overlap window."""
    return max(int(tokens), 0).bit_length()


class StagingChooser:
    """Picks `whole`, `routed` or `host` for each step under `policy` (auto, whole, routed, host)."""

    def __init__(self, policy: str, top_k: int | None, experts: int, explore_every_steps: int = 64,
                 measure_steps: bool = False, pair_within_steps: int = 8, host_capable: bool = False) -> None:
        if policy not in STAGING_POLICIES:
            raise ValueError(f"staging policy must be one of {', '.join(STAGING_POLICIES)} (got {policy!r})")
        if policy == "auto" and not top_k:
            raise ValueError("staging policy auto needs the router's top_k")
        if policy == HOST and not host_capable:
            raise ValueError("staging policy host needs layers whose cold experts can be computed on the host")
        self.policy, self.top_k, self.experts = policy, top_k or 0, experts
        self.modes = (WHOLE, ROUTED, HOST) if host_capable else (WHOLE, ROUTED)
        self.explore_every_steps = explore_every_steps
        self.measure_steps, self.pair_within_steps = measure_steps, pair_within_steps
        # host, per token bucket: mode -> (seconds per token smoothed over its latest run, that run's last step)
        self._runs: dict[int, dict[str, tuple[float, int]]] = {}
        self._latest_mode: dict[int, str] = {}  # the mode of the bucket's latest measured step
        self._verdict: dict[int, str] = {}  # the fastest mode at the bucket's latest switch
        self.whole_bw_bytes_per_s: float | None = None
        self.routed_bw_bytes_per_s: float | None = None
        self.routed_ratio = 1.0  # observed distinct offloaded rows / the uniform expectation
        self._window_s: dict[int, float] = {}  # token bucket -> overlap window per eligible layer
        self._last_whole_step: dict[int, int] = {}
        self.layers_without_ids: set[int] = set()  # eligible layers whose router output has no expert ids
        self.cold_share: float | None = None  # observed share of top-k slots routed to offloaded rows
        self._host_s_per_pair: dict[int, float] = {}  # token bucket -> measured host seconds per pair
        self._last_host_step: dict[int, int] = {}

    def without_routed_ids(self, layer_id: int) -> None:
        """Layer `layer_id`'s MoE kernel gets no expert ids: from now on every step is whole."""
        if self.policy != WHOLE and not self.layers_without_ids:
            logger.warning("vamp: MoE layer %d's router output carries no expert ids (a top-k format that "
                           "routes inside the MoE kernel); staging %s runs whole-region steps instead",
                           layer_id, self.policy)
        self.layers_without_ids.add(layer_id)

    def choose(self, step: int, tokens: int | None, whole_layer_bytes: int, offloaded_rows: int,
               row_bytes: int) -> str:
        """The mode of a step with `tokens` tokens (None: unknown, whole)."""
        if self.layers_without_ids:
            return WHOLE
        if self.policy != "auto":
            return self.policy
        if tokens is None or offloaded_rows == 0:
            return WHOLE
        bucket = token_bucket(tokens)
        if bucket not in self._window_s or self.whole_bw_bytes_per_s is None \
                or step - self._last_whole_step.get(bucket, step) >= self.explore_every_steps:
            return WHOLE
        if self.measure_steps:
            runs = self._runs.get(bucket, {})  # the verdict holds while every mode ran recently
            if bucket in self._verdict and len(runs) == len(self.modes) \
                    and all(step - last < self.explore_every_steps for _, last in runs.values()):
                return self._verdict[bucket]
            return self._least_recent(bucket)  # a step to pair with the latest
        if HOST in self.modes and (bucket not in self._host_s_per_pair
                                   or step - self._last_host_step[bucket] >= self.explore_every_steps):
            return HOST
        costs = {WHOLE: self.whole_s(tokens, whole_layer_bytes),
                 ROUTED: self.routed_s(tokens, offloaded_rows, row_bytes)}
        if HOST in self.modes:
            costs[HOST] = self.host_s(tokens, offloaded_rows)
        return min(self.modes, key=costs.__getitem__)  # ties: the earlier mode

    def _least_recent(self, bucket: int) -> str:
        """The mode other than the bucket's latest whose last measured step is oldest (never run: first)."""
        runs, latest = self._runs.get(bucket, {}), self._latest_mode.get(bucket)
        others = [m for m in self.modes if m != latest]
        return min(others, key=lambda m: runs[m][1] if m in runs else -1)

    def whole_s(self, tokens: int, whole_layer_bytes: int) -> float:
        """Exposed seconds per layer of a whole-region prefetch."""
        bw = self.whole_bw_bytes_per_s or float("inf")
        return max(0.0, whole_layer_bytes / bw - self._window_s.get(token_bucket(tokens), 0.0))

    def routed_s(self, tokens: int, offloaded_rows: int, row_bytes: int) -> float:
        """Seconds per layer of a routed-only copy (not overlapped)."""
        bw = self.routed_bw_bytes_per_s or self.whole_bw_bytes_per_s or float("inf")
        return self.expected_rows(tokens, offloaded_rows) * row_bytes / bw

    def host_s(self, tokens: int, offloaded_rows: int) -> float:
        """Seconds per layer of computing the expected cold pairs on the host at the bucket's measured rate."""
        share = self.cold_share if self.cold_share is not None else offloaded_rows / max(self.experts, 1)
        return tokens * self.top_k * share * self._host_s_per_pair.get(token_bucket(tokens), 0.0)

    def expected_rows(self, tokens: int, offloaded_rows: int) -> float:
        fraction = expected_routed_fraction(self.top_k, self.experts, tokens)
        return min(offloaded_rows, offloaded_rows * fraction * self.routed_ratio)

    def observe_whole(self, step: int, tokens: int | None, nbytes: int, copy_s: float, wait_s: float) -> None:
        """One whole-region copy, with its measured copy time and the compute side's exposed wait."""
        if copy_s <= 0 or nbytes <= 0:
            return
        self.whole_bw_bytes_per_s = smooth(self.whole_bw_bytes_per_s, nbytes / copy_s)
        if tokens is not None:
            bucket = token_bucket(tokens)
            self._window_s[bucket] = smooth(self._window_s.get(bucket), max(copy_s - wait_s, 0.0))
            self._last_whole_step[bucket] = step

    def observe_step(self, step: int, tokens: int | None, mode: str, seconds: float) -> None:
        """A measured step of `mode` (host): forward start to the last eligible layer's MoE. A step that
        switches its bucket's mode is compared with the other mode's run right before it."""
        if not tokens or seconds <= 0:
            return
        bucket, s_per_token = token_bucket(tokens), seconds / tokens
        runs = self._runs.setdefault(bucket, {})
        switched = self._latest_mode.get(bucket) != mode
        runs[mode] = (s_per_token if switched else smooth(runs[mode][0], s_per_token), step)
        self._latest_mode[bucket] = mode
        near = [m for m, (_, last) in runs.items() if step - last <= self.pair_within_steps]
        if switched and len(near) > 1:
            self._verdict[bucket] = min(near, key=lambda m: runs[m][0])

    def observe_host(self, step: int, tokens: int | None, pairs: int, seconds: float) -> None:
        """One host-mode layer computed `pairs` cold pairs in `seconds`, the layer call's wall time (on CPU
        servers the masked kernel's too: an upper bound, but there measured step times decide)."""
        if not tokens or not self.top_k:
            return
        bucket = token_bucket(tokens)
        self.cold_share = smooth(self.cold_share, pairs / (tokens * self.top_k))
        self._last_host_step[bucket] = step
        if pairs > 0 and seconds > 0:
            self._host_s_per_pair[bucket] = smooth(self._host_s_per_pair.get(bucket) or None, seconds / pairs)
        else:
            self._host_s_per_pair.setdefault(bucket, 0.0)  # nothing cold: free until a pair is timed

    def observe_routed(self, tokens: int | None, nbytes: int, copy_s: float, rows: int | None,
                       offloaded_rows: int) -> None:
        """One routed-only copy; `rows` is the distinct offloaded rows it copied when known (host)."""
        if copy_s > 0 and nbytes > 0:
            self.routed_bw_bytes_per_s = smooth(self.routed_bw_bytes_per_s, nbytes / copy_s)
        if rows is not None and tokens and offloaded_rows and self.top_k:
            expected = offloaded_rows * expected_routed_fraction(self.top_k, self.experts, tokens)
            if expected > 0:
                self.routed_ratio = smooth(self.routed_ratio, rows / expected)
