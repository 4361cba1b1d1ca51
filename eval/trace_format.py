"""The session-trace format every workload is converted to, and its validator.

One JSON object per line, one line per request (one agent or chat turn):

    {"session": str, "turn": int, "arrival_s": float | null, "think_time_s": float | null,
     "input_tokens": int, "output_tokens": int, "hash_ids": [int, ...], "block_tokens": int}

`hash_ids` names the prompt's blocks of `block_tokens` tokens (the last one may be partial), so
`len(hash_ids) == ceil(input_tokens / block_tokens)`. Requests with equal leading hash ids share those
blocks; the replay turns each id into the same token ids (eval.synth). A session's turns are numbered
0, 1, 2, ... in file order; `arrival_s` is when turn 0 may start (null: at once) and `think_time_s` is
the pause after the previous turn's answer before this turn is sent (null: none).

Why one format: Mooncake, SWE-agent and the generated multi-turn workload all replay through the same
client, so every configuration sees the same fixed request sequence (paper section VI-A).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_TRACES_DIR = "VAMP_TRACES_DIR"
FIELDS = ("session", "turn", "arrival_s", "think_time_s", "input_tokens", "output_tokens", "hash_ids",
          "block_tokens")


class TraceFormatError(ValueError):
    """A bad trace line; the message names the file, the line number and the field."""


@dataclass(frozen=True)
class TraceRequest:
    session: str
    turn: int
    arrival_s: float | None
    think_time_s: float | None
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    block_tokens: int

    def to_json(self) -> str:
        record = asdict(self)
        record["hash_ids"] = list(self.hash_ids)
        return json.dumps(record, separators=(",", ":"))


def traces_dir() -> Path:
    """The shared public traces, read in place: `../shared/traces` from the repo root, or $VAMP_TRACES_DIR."""
    override = os.environ.get(ENV_TRACES_DIR)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: object) -> bool:
    if value is None:
        return True
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and value >= 0


def _field_errors(obj: dict) -> list[str]:
    missing = [name for name in FIELDS if name not in obj]
    unknown = sorted(set(obj) - set(FIELDS))
    errors = [f"missing field {name!r}" for name in missing] + [f"unknown field {name!r}" for name in unknown]
    if missing:
        return errors
    checks = [
        ("session", isinstance(obj["session"], str) and obj["session"] != "", "a non-empty string"),
        ("turn", _is_int(obj["turn"]) and obj["turn"] >= 0, "an integer >= 0"),
        ("arrival_s", _is_time(obj["arrival_s"]), "a finite number >= 0 or null"),
        ("think_time_s", _is_time(obj["think_time_s"]), "a finite number >= 0 or null"),
        ("input_tokens", _is_int(obj["input_tokens"]) and obj["input_tokens"] >= 1, "an integer >= 1"),
        ("output_tokens", _is_int(obj["output_tokens"]) and obj["output_tokens"] >= 1, "an integer >= 1"),
        ("block_tokens", _is_int(obj["block_tokens"]) and obj["block_tokens"] >= 1, "an integer >= 1"),
        ("hash_ids", isinstance(obj["hash_ids"], list)
         and all(_is_int(h) and h >= 0 for h in obj["hash_ids"]), "a list of integers >= 0"),
    ]
    errors += [f"field {name!r} must be {what} (got {obj[name]!r})" for name, ok, what in checks if not ok]
    if not errors:
        want_blocks = math.ceil(obj["input_tokens"] / obj["block_tokens"])
        if len(obj["hash_ids"]) != want_blocks:
            errors.append(f"field 'hash_ids' must have ceil(input_tokens / block_tokens) = {want_blocks} "
                          f"entries (got {len(obj['hash_ids'])})")
    return errors


def parse_request(line: str, where: str) -> TraceRequest:
    """One line to a TraceRequest, or TraceFormatError naming `where` (file:line) and the field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    errors = _field_errors(obj)
    if errors:
        raise TraceFormatError(f"{where}: " + "; ".join(errors))
    return TraceRequest(
        session=obj["session"], turn=obj["turn"],
        arrival_s=None if obj["arrival_s"] is None else float(obj["arrival_s"]),
        think_time_s=None if obj["think_time_s"] is None else float(obj["think_time_s"]),
        input_tokens=obj["input_tokens"], output_tokens=obj["output_tokens"],
        hash_ids=tuple(obj["hash_ids"]), block_tokens=obj["block_tokens"])


def check_turn_order(requests: list[TraceRequest], where: list[str]) -> None:
    """Each session's turns must read 0, 1, 2, ... in file order: turn n+1 extends turn n's context."""
    next_turn: dict[str, int] = {}
    for request, place in zip(requests, where):
        expected = next_turn.get(request.session, 0)
        if request.turn != expected:
            raise TraceFormatError(f"{place}: field 'turn' of session {request.session!r} must be "
                                   f"{expected} (got {request.turn})")
        next_turn[request.session] = expected + 1


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read and validate a whole trace; blank lines are skipped, every error names its line."""
    requests: list[TraceRequest] = []
    where: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            place = f"{path}:{number}"
            requests.append(parse_request(line, place))
            where.append(place)
    if not requests:
        raise TraceFormatError(f"{path}: the trace holds no requests")
    check_turn_order(requests, where)
    return requests


def dump_trace(requests: list[TraceRequest], path: str | Path) -> None:
    check_turn_order(requests, [f"request {i}" for i in range(len(requests))])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(request.to_json() + "\n" for request in requests)


def scale_request(request: TraceRequest, scale: float) -> TraceRequest:
    """Shrink token counts by `scale` (a tiny CPU model has a short context and a small pool).

    Block size shrinks with the prompt and the hash ids are kept, so sharing stays block for block;
    the prompt length is clamped so the block count still equals len(hash_ids).
    """
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1] (got {scale!r})")
    block_tokens = max(1, round(request.block_tokens * scale))
    blocks = len(request.hash_ids)
    input_tokens = min(max(round(request.input_tokens * scale), (blocks - 1) * block_tokens + 1),
                       blocks * block_tokens)
    return TraceRequest(request.session, request.turn, request.arrival_s, request.think_time_s,
                        input_tokens, max(1, round(request.output_tokens * scale)), request.hash_ids,
                        block_tokens)
