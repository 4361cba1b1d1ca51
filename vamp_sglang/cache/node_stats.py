"""What the tree remembers about reuse: per-node hits and recency, and the tree-wide hit rate.

Both are counted at request ADMISSION, not at prefix match: SGLang re-matches every waiting
request on every scheduling round (priority computation, `init_next_round_input`), so a request
that waits ten rounds would count ten hits if matches counted. An admission happens once per
request (retracted requests re-enter admission, and are not counted again, like SGLang's own
`cached_tokens`). Time is in scheduler steps (`Scheduler.forward_ct`, launched batches), the unit
of the paper's tau (Eq. 1, tau = 2,000 steps), not wall time, so it is identical on every TP rank.
"""

from __future__ import annotations


class NodeStats:
    """Reuse statistics of one radix node; mutated in place as requests are admitted.

    `hits` counts admitted requests whose matched prefix ran through this node, so along any root
    path a parent's hits are >= its child's. `last_step` is the last admission through the node
    or write into it (insert); `created_step` breaks ties between equally valued nodes.
    `prior` is the prefix-hit rate of the request that wrote the node (None: unknown): it names the
    writer class whose observed reuse share prices the node before its own first hit
    (cache/reuse_share.py). A continuation of a cached conversation (hit rate ~0.9) writes KV its
    own next turn will likely reuse; a first turn or one-shot prompt (hit rate ~0) writes KV that
    is reused as often as such KV has been, which the tree measures.
    """

    __slots__ = ("created_step", "hits", "last_step", "prior")

    def __init__(self, step: int, hits: int = 0, created_step: int | None = None,
                 prior: float | None = None) -> None:
        if step < 0 or hits < 0:
            raise ValueError(f"NodeStats needs step >= 0 and hits >= 0 (got {step!r}, {hits!r})")
        if prior is not None and not 0.0 <= prior <= 1.0:
            raise ValueError(f"NodeStats.prior must be a hit rate in [0, 1] (got {prior!r})")
        self.hits = hits
        self.last_step = step
        self.created_step = step if created_step is None else created_step
        self.prior = prior

    def admit(self, step: int, count_hit: bool) -> None:
        """An admitted request reuses this node (`count_hit` False: a retracted request's return)."""
        if count_hit:
            self.hits += 1
        self.touch(step)

    def touch(self, step: int) -> None:
        self.last_step = max(self.last_step, step)

    def age_steps(self, now_step: int) -> int:
        """Steps since last use, never negative (a stats source bound late may restart from 0)."""
        return max(now_step - self.last_step, 0)

    def copy(self) -> NodeStats:
        """For the prefix half of a split node: every request through the child passed through it."""
        return NodeStats(self.last_step, self.hits, self.created_step, self.prior)

    def __repr__(self) -> str:
        return (f"NodeStats(hits={self.hits}, last_step={self.last_step}, created_step={self.created_step}, "
                f"prior={self.prior})")


class AdmissionLedger:
    """Prompt tokens served from the prefix cache / prompt tokens, over first admissions.

    This is the observed hit rate the paper's r_hit starts from (Eq. 1), measured the way SGLang
    reports `cached_tokens` in usage: the device prefix at a request's first admission.
    """

    __slots__ = ("admissions", "hit_tokens", "requested_tokens")

    def __init__(self) -> None:
        self.admissions = 0
        self.hit_tokens = 0
        self.requested_tokens = 0

    def record(self, hit_tokens: int, requested_tokens: int) -> None:
        if not 0 <= hit_tokens <= requested_tokens:
            raise ValueError(
                f"an admission needs 0 <= hit_tokens <= requested_tokens (got {hit_tokens!r}, {requested_tokens!r})"
            )
        self.admissions += 1
        self.hit_tokens += hit_tokens
        self.requested_tokens += requested_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0
