"""The reusable prefix footprint of a session trace, and how many of its sessions a pool holds.

Paper VI-E: the capacity boundary is where the sessions' reusable prefixes (each session's context,
which its next turn extends) no longer fit in the KV pool. A session's footprint is its largest turn:
prompt blocks plus the answer the next turn will reuse. Blocks with equal hash ids are the same tokens
(eval/trace_format.py), so sessions that share a system prompt hold it once. The sessions of a trace
are taken as live together, as in the multi-turn workload where all of them start at t=0.

The trace is read with the project's own validator (eval.trace_format), imported only when a trace is
given: the planner itself needs nothing from eval/.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SessionFootprint:
    session: str
    blocks: tuple[tuple[int, int], ...]  # (hash id, tokens) of the largest turn's prompt
    output_tokens: int

    @property
    def tokens(self) -> int:
        return sum(tokens for _, tokens in self.blocks) + self.output_tokens


def load_footprints(path: str) -> list[SessionFootprint]:
    """Every session's footprint in a session-trace file (TraceFormatError names a bad line)."""
    try:
        from eval.trace_format import load_trace
    except ImportError:
        raise ImportError("--trace needs the repository's eval/ package on the path (run from the "
                          "repository root)") from None
    return footprints(load_trace(path))


def footprints(requests: Iterable[Any]) -> list[SessionFootprint]:
    """One footprint per session (in first-seen order) from TraceRequest-like records."""
    largest: dict[str, Any] = {}
    for request in requests:
        best = largest.get(request.session)
        if best is None or request.input_tokens + request.output_tokens > best.input_tokens + best.output_tokens:
            largest[request.session] = request
    return [SessionFootprint(name, _blocks(r), r.output_tokens) for name, r in largest.items()]


def _blocks(request: Any) -> tuple[tuple[int, int], ...]:
    """A prompt's blocks with their token counts: the last block holds what is left over."""
    n = len(request.hash_ids)
    last = request.input_tokens - (n - 1) * request.block_tokens
    return tuple((h, request.block_tokens if i < n - 1 else last) for i, h in enumerate(request.hash_ids))


def union_tokens(sessions: Iterable[SessionFootprint]) -> int:
    """KV tokens these sessions hold together: shared blocks once, every answer on its own."""
    totals = _running_union(sessions)
    return totals[-1] if totals else 0


def sessions_held(sessions: Sequence[SessionFootprint], pool_tokens: int) -> int:
    """The most sessions a pool of `pool_tokens` holds whichever of the trace's sessions they are:
    the largest k for which the k largest footprints fit together."""
    ranked = sorted(sessions, key=lambda s: s.tokens, reverse=True)
    return sum(1 for total in _running_union(ranked) if total <= pool_tokens)


def _running_union(sessions: Iterable[SessionFootprint]) -> list[int]:
    """Tokens held by the first 1, 2, ... sessions together (non-decreasing)."""
    blocks: dict[int, int] = {}
    total, out = 0, []
    for s in sessions:
        for hash_id, tokens in s.blocks:
            old = blocks.get(hash_id, 0)
            if tokens > old:
                blocks[hash_id] = tokens
                total += tokens - old
        total += s.output_tokens
        out.append(total)
    return out
