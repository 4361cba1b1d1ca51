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
    admit_tick: int = 0  # the closed-loop schedule (`closed_loop`); 0 one request at a time
    finish_tick: int = 0
    last_turn: bool = False  # the session's last request in replay order: a client closes its session after it

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


def closed_loop(trace: list[TraceRequest], sessions: int | None, concurrency: int,
                pool_tokens: int) -> list[tuple[TraceRequest, int, int]]:
    """(request, admission tick, finish tick) in admission order, for `concurrency` C > 1.

    The scheduler as a clock of steps: a FIFO waiting queue; the head is admitted while fewer than
    C run and the running requests' KV (prompt and answer each, shared prefixes counted apart) fits
    the pool; a request runs 1 + output_tokens steps (prefill, then one token a step); when it
    finishes, its session's next turn joins the back of the queue (no think time), or, if that was
    the session's last, the next waiting session's first turn. This order does not depend on the
    eviction policy (a running request needs its whole KV whatever the tree holds), so every policy
    and the oracle replay the same one; it does depend on the pool size."""
    waiting_sessions = deque(deque(turns) for turns in group_sessions(trace))
    slots = len(waiting_sessions) if sessions is None else sessions
    queue: deque[tuple[TraceRequest, deque]] = deque()
    for _ in range(min(slots, len(waiting_sessions))):
        turns = waiting_sessions.popleft()
        queue.append((turns.popleft(), turns))
    running: list[tuple[int, TraceRequest, deque, int]] = []  # (finish tick, request, rest, tokens)
    used, tick, order = 0, 0, []
    while queue or running:
        while queue and len(running) < concurrency:
            request, rest = queue[0]
            size = _size(request)
            if running and used + size > pool_tokens:
                break
            queue.popleft()
            used += size
            finish = tick + 1 + request.output_tokens
            running.append((finish, request, rest, size))
            order.append((request, tick, finish))
        tick = min(f for f, *_ in running)
        for entry in [e for e in running if e[0] == tick]:
            running.remove(entry)
            _, request, rest, size = entry
            used -= size
            if not rest and waiting_sessions:
                rest = waiting_sessions.popleft()
            if rest:
                queue.append((rest.popleft(), rest))
    return order


def _size(request: TraceRequest) -> int:
    return request.input_tokens + request.output_tokens


def build_requests(trace: list[TraceRequest], sessions: int | None, concurrency: int = 1,
                   pool_tokens: int | None = None) -> list[SimRequest]:
    """Token ids of every request, in replay order: `interleave` one request at a time, else
    `closed_loop` at `concurrency` over a pool of `pool_tokens`."""
    if concurrency > 1:
        if pool_tokens is None:
            raise ValueError("a closed-loop order needs the pool size")
        schedule = closed_loop(trace, sessions, concurrency, pool_tokens)
    else:
        schedule = [(r, 0, 0) for r in interleave(trace, sessions)]
    context: dict[str, list[int]] = {}
    last = {request.session: index for index, (request, _, _) in enumerate(schedule)}
    out = []
    for index, (request, admit_tick, finish_tick) in enumerate(schedule):
        history = context.get(request.session, [])
        prompt = history + new_turn_tokens(request, len(history), SPACE)
        answer_id = _ANSWER_IDS + index
        answer = [block_token(answer_id, k, SPACE) for k in range(request.output_tokens)]
        out.append(SimRequest(index, request.session, request.turn, prompt, answer, admit_tick, finish_tick,
                              last[request.session] == index))
        context[request.session] = prompt + answer
    return out


def decode_steps(request: SimRequest, concurrency: int) -> int:
    """Scheduler steps one request advances the clock by (VAMP's ages, Eq. 1's tau): its prefill
    and decode steps, shared with the other requests of a batch of `concurrency`."""
    return math.ceil((1 + len(request.answer)) / concurrency)
