"""One streamed request against SGLang's `/generate` (token ids) or its OpenAI-compatible text APIs.

TTFT is measured at the client, from sending the request to the first chunk that carries a generated
token (paper section VI-A: "TTFT uses client first-token timestamps"). Greedy decoding
(temperature 0) keeps answers identical across configurations, which the closed loop depends on.

Under DP attention a prefix hits only on the DP rank whose radix tree holds it, and SGLang 0.5.23 spreads
requests round robin by default (`--load-balance-method auto`). `routed_dp_rank` (a field of `/generate` and of
the OpenAI requests) sends a request to one DP rank; `dp_rank_for` picks a session's rank.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

API_MODES = ("generate", "completions", "chat")


@dataclass
class Answer:
    ok: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None


def dp_rank_for(session: str, dp_ranks: int, pinned: int | None = None) -> int | None:
    """The DP rank a session's requests go to: `pinned` for every session, else with `dp_ranks` > 1 a stable
    hash of the session id (crc32: the same in every run and every client process, as a sticky router's),
    so every turn lands where its previous turns were cached; None leaves the choice to SGLang."""
    if pinned is not None:
        return pinned
    return zlib.crc32(session.encode()) % dp_ranks if dp_ranks > 1 else None


def _routed(body: dict[str, Any], routed_dp_rank: int | None) -> dict[str, Any]:
    return body if routed_dp_rank is None else body | {"routed_dp_rank": routed_dp_rank}


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Decoded `data:` events of a server-sent-event stream, up to `[DONE]`."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def _sampling(max_new_tokens: int, exact_output: bool) -> dict[str, Any]:
    """Greedy; with `exact_output` the answer has exactly max_new_tokens tokens (EOS is not allowed
    earlier), so context growth per turn is the trace's, whatever the model."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    if exact_output:
        params["min_new_tokens"] = max_new_tokens
    return params


async def _post_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], answer: Answer,
                       on_event: Any) -> Answer:
    start = time.perf_counter()
    try:
        async with http.post(url, json=body) as response:
            if response.status != 200:
                answer.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return answer
            async for event in _sse_events(response):
                if "error" in event:
                    answer.error = str(event["error"])[:300]
                    return answer
                had_tokens = answer.output_tokens > 0 or answer.text
                on_event(event, answer)
                if answer.error is not None:
                    return answer
                if not had_tokens and (answer.output_tokens > 0 or answer.text):
                    answer.ttft_s = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:300]
        return answer
    answer.latency_s = time.perf_counter() - start
    answer.ok = answer.ttft_s is not None
    if not answer.ok:
        answer.error = "stream ended without a generated token"
    return answer


def _on_generate_event(event: dict[str, Any], answer: Answer) -> None:
    """Output ids come cumulative (default) or as deltas (--incremental-streaming-output). A refused
    request (e.g. longer than the pool) still streams one chunk, whose finish reason is an abort."""
    meta = event.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        answer.error = f"abort ({finish.get('status_code', '?')}): {finish.get('message', '')}"[:300]
        return
    ids = [int(i) for i in event.get("output_ids", [])]
    completion_tokens = int(meta.get("completion_tokens", len(ids)))
    answer.output_ids = ids if len(ids) == completion_tokens else answer.output_ids + ids
    answer.output_tokens = len(answer.output_ids)
    answer.prompt_tokens = int(meta.get("prompt_tokens", answer.prompt_tokens))
    if "cached_tokens" in meta:
        answer.cached_tokens = int(meta["cached_tokens"])
    if event.get("text") is not None:
        answer.text = event["text"]


async def generate(http: aiohttp.ClientSession, url: str, input_ids: list[int], max_new_tokens: int,
                   exact_output: bool = True, routed_dp_rank: int | None = None) -> Answer:
    body = {"input_ids": input_ids, "sampling_params": _sampling(max_new_tokens, exact_output), "stream": True}
    return await _post_stream(http, f"{url}/generate", _routed(body, routed_dp_rank), Answer(), _on_generate_event)


def _on_openai_event(event: dict[str, Any], answer: Answer) -> None:
    for choice in event.get("choices", []):
        if choice.get("finish_reason") == "abort":
            answer.error = f"abort: {choice.get('matched_stop') or choice}"[:300]
            return
        piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if piece:
            answer.text += piece
            answer.output_tokens = max(answer.output_tokens, 1)
    usage = event.get("usage")
    if usage:
        answer.prompt_tokens = int(usage.get("prompt_tokens", 0))
        answer.output_tokens = int(usage.get("completion_tokens", answer.output_tokens))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            answer.cached_tokens = int(details["cached_tokens"])


def _openai_body(model: str, max_new_tokens: int, exact_output: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_new_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if exact_output:
        body["min_tokens"] = max_new_tokens
    return body


async def completions(http: aiohttp.ClientSession, url: str, model: str, prompt: str, max_new_tokens: int,
                      exact_output: bool = True, routed_dp_rank: int | None = None) -> Answer:
    body = _openai_body(model, max_new_tokens, exact_output) | {"prompt": prompt}
    return await _post_stream(http, f"{url}/v1/completions", _routed(body, routed_dp_rank), Answer(),
                              _on_openai_event)


async def chat(http: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]],
               max_new_tokens: int, exact_output: bool = True, routed_dp_rank: int | None = None) -> Answer:
    body = _openai_body(model, max_new_tokens, exact_output) | {"messages": messages}
    return await _post_stream(http, f"{url}/v1/chat/completions", _routed(body, routed_dp_rank), Answer(),
                              _on_openai_event)
