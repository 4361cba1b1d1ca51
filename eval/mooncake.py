"""Import the Mooncake conversation trace (`{"timestamp": ms, "input_length", "output_length", "hash_ids"}`).

The trace has no session ids, so sessions are rebuilt as prefix chains: a request continues the
session whose latest turn `p` it extends, i.e. it repeats all of `p`'s full blocks (every block but
`p`'s last, which may have been partial and so hashed differently) and at least two blocks in all
(block 0 alone is a system prompt every request shares). A request that extends a turn which already
has a successor starts a new session: a session is one linear conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

from eval.trace_format import TraceFormatError, TraceRequest

BLOCK_TOKENS = 512  # one hash id per 512-token block (traces/README.md)
MIN_SHARED_BLOCKS = 2


def _read_rows(path: Path, max_requests: int | None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if max_requests is not None and len(rows) >= max_requests:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"timestamp", "input_length", "output_length", "hash_ids"} - set(row)
            if missing:
                raise TraceFormatError(f"{path}:{number}: Mooncake record lacks {sorted(missing)}")
            rows.append(row)
    return rows


def _chain_key(hash_ids: list[int]) -> tuple[int, ...]:
    """What a successor must repeat: every full block (all but the last), or all when that is too few."""
    full = hash_ids[:-1]
    return tuple(full if len(full) >= MIN_SHARED_BLOCKS else hash_ids)


def import_mooncake(path: str | Path, max_requests: int | None = None) -> list[TraceRequest]:
    """Requests in file (arrival) order, grouped into sessions named `mc<first request index>`."""
    rows = _read_rows(Path(path), max_requests)
    tails: dict[tuple[int, ...], int] = {}  # chain key of a session's latest turn -> its row index
    session_of: dict[int, tuple[str, int]] = {}  # row index -> (session, turn)
    requests = []
    for index, row in enumerate(rows):
        hash_ids = list(row["hash_ids"])
        parent = None
        for length in range(len(hash_ids), MIN_SHARED_BLOCKS - 1, -1):
            parent = tails.get(tuple(hash_ids[:length]))
            if parent is not None:
                break
        if parent is None:
            session, turn = f"mc{index}", 0
            arrival_s, think_time_s = row["timestamp"] / 1000.0, None
        else:
            del tails[_chain_key(rows[parent]["hash_ids"])]
            session, turn = session_of[parent][0], session_of[parent][1] + 1
            arrival_s = None
            think_time_s = max(0.0, (row["timestamp"] - rows[parent]["timestamp"]) / 1000.0)
        session_of[index] = (session, turn)
        tails[_chain_key(hash_ids)] = index
        requests.append(TraceRequest(session, turn, arrival_s, think_time_s, int(row["input_length"]),
                                     max(1, int(row["output_length"])), tuple(hash_ids), BLOCK_TOKENS))
    return requests
