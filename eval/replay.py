"""Closed-loop replay of a session trace: each session sends its turns in order, turn n+1 only after
turn n's answer arrived and the think time passed, with its prompt extended by that answer.

At most `max_sessions` sessions are active at once (the paper replays its traces "at 64 or 128
sessions"); a session starts at its arrival time or when a slot frees, whichever is later.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from eval import client
from eval.stats import RequestRecord
from eval.synth import TokenSpace, new_turn_tokens
from eval.trace_format import TraceRequest


@dataclass(frozen=True)
class ReplayOptions:
    url: str
    api: str = "generate"  # generate (token ids), completions or chat (text)
    model: str = "default"  # OpenAI `model` field for the text APIs
    max_sessions: int | None = None  # concurrent sessions; None = all
    time_scale: float = 1.0  # multiplies arrival and think times
    max_duration_s: float | None = None  # issue no new turn after this; in-flight turns finish
    exact_output: bool = True  # min_new_tokens = max_new_tokens: deterministic context growth
    min_new_tokens: int = 1  # user tokens added per turn when answers already exceed the trace
    request_timeout_s: float = 900.0
    progress: bool = True
    dp_sticky: int = 0  # DP attention: hash each session to one of this many DP ranks (client.dp_rank_for)
    dp_rank: int | None = None  # DP attention: send every session to this DP rank

    def validate(self) -> ReplayOptions:
        if self.api not in client.API_MODES:
            raise ValueError(f"--api must be one of {', '.join(client.API_MODES)} (got {self.api!r})")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError(f"--sessions must be >= 1 (got {self.max_sessions})")
        if self.time_scale < 0:
            raise ValueError(f"--time-scale must be >= 0 (got {self.time_scale})")
        if self.dp_sticky < 0 or (self.dp_rank is not None and self.dp_rank < 0):
            raise ValueError(f"--dp-sticky and --dp-rank must be >= 0 (got {self.dp_sticky}, {self.dp_rank})")
        return self


class SessionContext:
    """A session's conversation so far, in the form its API mode sends (ids, text, or messages)."""

    def __init__(self, options: ReplayOptions, space: TokenSpace, tokenizer: Any | None) -> None:
        if options.api != "generate" and tokenizer is None:
            raise ValueError(f"--api {options.api} needs the model's tokenizer to turn token ids into text")
        self.options, self.space, self.tokenizer = options, space, tokenizer
        self.ids: list[int] = []
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.context_tokens = 0

    async def send(self, http: aiohttp.ClientSession, request: TraceRequest) -> client.Answer:
        new_ids = new_turn_tokens(request, self.context_tokens, self.space, self.options.min_new_tokens)
        opts = self.options
        dp = client.dp_rank_for(request.session, opts.dp_sticky, opts.dp_rank)
        if opts.api == "generate":
            self.ids += new_ids
            answer = await client.generate(http, opts.url, self.ids, request.output_tokens, opts.exact_output, dp)
            self.ids += answer.output_ids
            self.context_tokens = len(self.ids)
            return answer
        new_text = self.tokenizer.decode(new_ids)
        if opts.api == "completions":
            self.text += new_text
            answer = await client.completions(http, opts.url, opts.model, self.text, request.output_tokens,
                                              opts.exact_output, dp)
            self.text += answer.text
        else:
            self.messages.append({"role": "user", "content": new_text})
            answer = await client.chat(http, opts.url, opts.model, self.messages, request.output_tokens,
                                       opts.exact_output, dp)
            self.messages.append({"role": "assistant", "content": answer.text})
        self.context_tokens = max(self.context_tokens + len(new_ids), answer.prompt_tokens) + answer.output_tokens
        return answer


def group_sessions(trace: list[TraceRequest]) -> list[list[TraceRequest]]:
    """Sessions in order of arrival (null counts as 0), ties in file order; turns in file order."""
    sessions: dict[str, list[TraceRequest]] = {}
    for request in trace:
        sessions.setdefault(request.session, []).append(request)
    return sorted(sessions.values(), key=lambda turns: turns[0].arrival_s or 0.0)


class Replayer:
    def __init__(self, trace: list[TraceRequest], options: ReplayOptions, space: TokenSpace,
                 tokenizer: Any | None = None) -> None:
        self.sessions = group_sessions(trace)
        self.options, self.space, self.tokenizer = options.validate(), space, tokenizer
        self.records: list[RequestRecord] = []
        self._t0 = 0.0

    def _expired(self) -> bool:
        limit = self.options.max_duration_s
        return limit is not None and time.perf_counter() - self._t0 >= limit

    async def _run_session(self, http: aiohttp.ClientSession, turns: list[TraceRequest],
                           slots: asyncio.Semaphore, bar: tqdm) -> None:
        scale = self.options.time_scale
        await asyncio.sleep(max(0.0, (turns[0].arrival_s or 0.0) * scale - (time.perf_counter() - self._t0)))
        async with slots:
            context = SessionContext(self.options, self.space, self.tokenizer)
            for request in turns:
                if request.turn > 0 and request.think_time_s:
                    await asyncio.sleep(request.think_time_s * scale)
                if self._expired():
                    return
                start_s = time.perf_counter() - self._t0
                answer = await context.send(http, request)
                self.records.append(RequestRecord(
                    request.session, request.turn, answer.ok, start_s, answer.ttft_s, answer.latency_s,
                    answer.prompt_tokens, answer.output_tokens, answer.cached_tokens,
                    tuple(answer.output_ids), answer.text if self.options.api != "generate" else "",
                    answer.error))
                bar.update(1)
                if not answer.ok:
                    bar.set_postfix_str(f"failed: {answer.error}"[:60])

    async def run(self, http: aiohttp.ClientSession) -> float:
        """Replay everything; returns the wall duration in seconds."""
        total = sum(len(turns) for turns in self.sessions)
        slots = asyncio.Semaphore(self.options.max_sessions or len(self.sessions))
        self._t0 = time.perf_counter()
        with tqdm(total=total, desc="requests", unit="req", disable=not self.options.progress) as bar:
            await asyncio.gather(*(self._run_session(http, turns, slots, bar) for turns in self.sessions))
        return time.perf_counter() - self._t0
