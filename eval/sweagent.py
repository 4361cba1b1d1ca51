"""Import SWE-agent `.traj` trajectories: each assistant turn becomes one request.

A turn's prompt is the chat history before that assistant message, rendered with the served model's
chat template and tokenised with its tokenizer, so prefix sharing is exact for that model. Blocks get
chained hash ids (a block's id depends on its tokens and every token before it, as in prefix caching),
numbered in order of first appearance across all files, so trajectories that share a system prompt
share its leading ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

from eval.trace_format import TraceFormatError, TraceRequest


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: list[dict], **kwargs: object) -> object: ...
    def encode(self, text: str, **kwargs: object) -> list[int]: ...


def _message_text(message: dict) -> str:
    """SWE-agent stores content as a string or as a list of {"type": "text", "text": ...} parts."""
    content = message.get("content", "")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _chat(messages: list[dict]) -> list[dict]:
    """Tool observations become user messages: small chat templates only know three roles."""
    roles = {"system": "system", "assistant": "assistant"}
    return [{"role": roles.get(m.get("role", "user"), "user"), "content": _message_text(m)} for m in messages]


def _prompt_ids(tokenizer: ChatTokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(_chat(messages), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(i) for i in ids]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in _chat(messages)) + "assistant: "
    return list(tokenizer.encode(text))


class BlockHasher:
    """Chained block hashes mapped to small integers in order of first appearance."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[bytes, int] = {}

    def hash_ids(self, token_ids: list[int]) -> tuple[int, ...]:
        ids, chain = [], b""
        for start in range(0, len(token_ids), self.block_tokens):
            block = token_ids[start:start + self.block_tokens]
            chain = hashlib.blake2b(chain + json.dumps(block).encode(), digest_size=16).digest()
            ids.append(self._ids.setdefault(chain, len(self._ids)))
        return tuple(ids)


def _think_times_s(trajectory: list[dict], turns: int) -> list[float | None]:
    """Recorded tool execution time before each turn, when the file has one step per assistant turn."""
    times: list[float | None] = [None] * turns
    if len(trajectory) == turns:
        for turn in range(1, turns):
            value = trajectory[turn - 1].get("execution_time")
            times[turn] = float(value) if isinstance(value, (int, float)) else None
    return times


def import_trajectory(path: Path, tokenizer: ChatTokenizer, hasher: BlockHasher) -> list[TraceRequest]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        history = data["history"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise TraceFormatError(f"{path}: not a SWE-agent trajectory with a 'history' list ({exc})") from None
    positions = [i for i, message in enumerate(history) if message.get("role") == "assistant"]
    think_times = _think_times_s(data.get("trajectory", []), len(positions))
    requests = []
    for turn, position in enumerate(positions):
        prompt = _prompt_ids(tokenizer, history[:position])
        output_tokens = max(1, len(tokenizer.encode(_message_text(history[position]),
                                                    add_special_tokens=False)))
        requests.append(TraceRequest(path.stem, turn, 0.0 if turn == 0 else None, think_times[turn],
                                     len(prompt), output_tokens, hasher.hash_ids(prompt),
                                     hasher.block_tokens))
    return requests


def import_sweagent(paths: list[Path], tokenizer: ChatTokenizer, block_tokens: int = 64) -> list[TraceRequest]:
    """All trajectories, one session each, in the order given (sorted by the CLI)."""
    hasher = BlockHasher(block_tokens)
    requests: list[TraceRequest] = []
    for path in paths:
        requests += import_trajectory(Path(path), tokenizer, hasher)
    return requests
