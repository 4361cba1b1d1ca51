"""The decision log: every decision in a bounded ring (for `/vamp/stats`) and optionally a JSONL file.

Each record holds the exact planner snapshot, so `python -m vamp_sglang.policy explain LOG.jsonl
--line N` replays the decision. Snapshots carry counts, hits and ages only: never token ids or text.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from vamp_sglang.policy.planner import Plan
from vamp_sglang.policy.restore import RestorePlan, RestoreState
from vamp_sglang.policy.snapshot import Snapshot


class DecisionLog:
    def __init__(self, capacity: int = 64, path: str | None = None) -> None:
        self._recent: deque[dict[str, Any]] = deque(maxlen=capacity)
        # The log file lives as long as the scheduler process; line buffering flushes each record.
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115

    def record(self, *, step: int, site: str, policy: str, snapshot: Snapshot, plan: Plan,
               decide_s: float, outcome: dict[str, Any]) -> dict[str, Any]:
        entry = {
            "step": step,
            "site": site,
            "gap_tokens": snapshot.gap_tokens,
            "policy": policy,
            "snapshot": snapshot.to_json(),
            "plan": plan.to_json(),
            "decide_ms": round(decide_s * 1e3, 3),
            "outcome": outcome,
        }
        self._recent.append(entry)
        if self._file is not None:
            self._file.write(json.dumps(entry, sort_keys=True) + "\n")
        return entry

    def record_restore(self, *, step: int, state: RestoreState, plan: RestorePlan, restored_groups: int,
                       pool_tokens: int) -> dict[str, Any]:
        """A restore attempt, with the state `explain` replays it from (`plan_restore`)."""
        entry = {"step": step, "site": "restore", "restore_state": state.to_json(), "plan": plan.to_json(),
                 "outcome": {"restored_groups": restored_groups, "pool_tokens": pool_tokens}}
        self._recent.append(entry)
        if self._file is not None:
            self._file.write(json.dumps(entry, sort_keys=True) + "\n")
        return entry

    def recent(self, limit: int = 16) -> list[dict[str, Any]]:
        """The newest decisions, without the bulky candidate lists of their snapshots."""
        out = []
        for entry in list(self._recent)[-limit:]:
            slim = {k: v for k, v in entry.items() if k != "snapshot"}
            snap = entry.get("snapshot")
            if snap is not None:
                slim["candidates"] = {"evictable": len(snap["evictable"]), "preempt": len(snap["preempt"])}
            out.append(slim)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
