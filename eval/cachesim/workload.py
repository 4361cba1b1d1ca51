"""A session trace as the simulator replays it: token ids per request, in a documented order.

Request order (`interleave`): sessions are taken in `eval.replay.group_sessions` order (arrival,
then file order); at most `sessions` of them are active at once and the active ones take turns,
one request each, round-robin: the order a closed loop with equal service times and no think time
issues them in (`eval.replay` with `max_sessions`). A session that has sent its last turn leaves
the rotation and the next waiting session joins at its end. With every session active this is
turn-major order (all turns 0, then all turns 1, ...), which is how the server sends the
multi-turn workload.

Tokens: turn n+1's prompt is turn n's prompt, turn n's answer, then the trace's new tokens
(`eval.synth.new_turn_tokens`, as the closed-loop client builds it). With no model, the answer is
`output_tokens` synthetic tokens unique to (session, turn), so it is shared by nothing but the same
session's later turns, as a model's answer is.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from eval.replay import group_sessions
from eval.synth import TokenSpace, block_token, new_turn_tokens
from eval.trace_format import TraceRequest

# wide enough that two unrelated blocks practically never start with the same token
SPACE = TokenSpace(16, 1 << 31)
_ANSWER_IDS = 1 << 40  # hash ids of answers: above every trace's ids


@dataclass(frozen=True)
class SimRequest:
    index: int  # position in replay order
    session: str
    turn: int
    prompt: list[int]
    answer: list[int]

    @property
    def tokens(self) -> list[int]:
        """What the request leaves in the cache when it finishes: prompt and answer."""
        return self.prompt + self.answer


def interleave(trace: list[TraceRequest], sessions: int | None) -> list[TraceRequest]:
    """The trace in replay order: round-robin over at most `sessions` active sessions (None: all)."""
    waiting = deque(deque(turns) for turns in group_sessions(trace))
    slots = len(waiting) if sessions is None else sessions
    if slots < 1:
        raise ValueError(f"--sessions must be >= 1 (got {sessions})")
    active: deque[deque[TraceRequest]] = deque()
    order = []
    while waiting or active:
        while waiting and len(active) < slots:
            active.append(waiting.popleft())
        turns = active.popleft()
        order.append(turns.popleft())
        if turns:
            active.append(turns)
    return order


def build_requests(trace: list[TraceRequest], sessions: int | None) -> list[SimRequest]:
    """Token ids of every request, in replay order."""
    context: dict[str, list[int]] = {}
    out = []
    for index, request in enumerate(interleave(trace, sessions)):
        history = context.get(request.session, [])
        prompt = history + new_turn_tokens(request, len(history), SPACE)
        answer_id = _ANSWER_IDS + index
        answer = [block_token(answer_id, k, SPACE) for k in range(request.output_tokens)]
        out.append(SimRequest(index, request.session, request.turn, prompt, answer))
        context[request.session] = prompt + answer
    return out


def decode_steps(request: SimRequest, concurrency: int) -> int:
    """Scheduler steps one request advances the clock by (VAMP's ages, Eq. 1's tau): its prefill
    and decode steps, shared with the other requests of a batch of `concurrency`."""
    return math.ceil((1 + len(request.answer)) / concurrency)
