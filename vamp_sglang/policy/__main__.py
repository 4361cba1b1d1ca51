"""`python -m vamp_sglang.policy explain [--json] [--line N] [--policy P] FILE`: why did it do that?

FILE is one snapshot (JSON), or a JSONL decision log whose records are `{"step": ..., "snapshot":
{...}, ...}`, of which `--line N` (1-based, default the last) is replayed. The plan is recomputed
from the snapshot with the paper's default coefficients plus the snapshot's own overrides, under
`--policy`, or the record's "policy" when it has one, or "cost". Exit status 2 on a bad file.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vamp_sglang.policy.costs import Coefficients
from vamp_sglang.policy.planner import COST_KEYS, POLICIES, Plan, plan
from vamp_sglang.policy.restore import RestoreState, plan_restore
from vamp_sglang.policy.snapshot import Snapshot, SnapshotError


class InputError(Exception):
    """The file cannot be read as a snapshot or a decision log."""


def _load_record(path: str, line: int | None) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        document = None  # not one JSON document: a JSONL log
    if document is not None:
        if line not in (None, 1):
            raise InputError(f"{path} holds a single JSON document; --line {line} does not exist")
        return document
    lines = text.splitlines()
    index = line if line is not None else max((i + 1 for i, t in enumerate(lines) if t.strip()), default=0)
    if not 1 <= index <= len(lines) or not lines[index - 1].strip():
        raise InputError(f"{path} has no record on line {index}")
    try:
        return json.loads(lines[index - 1])
    except json.JSONDecodeError as e:
        raise InputError(f"{path} line {index} is not JSON: {e.msg}") from None


def _describe(p: Plan, s: Snapshot, policy: str) -> str:
    added = s.offload_tokens(p.groups)
    what = {
        "none": "nothing to do: no gap",
        "offload": f"offload {p.groups} expert groups (+{added} KV tokens)",
        "evict": f"evict {p.evict_tokens} cached tokens in the tree's order (cache/ordering.py)",
        "preempt": "leave the gap; SGLang retracts running requests",
        "combined": f"offload {p.groups} expert groups (+{added} KV tokens) "
                    f"and evict {p.evict_tokens} cached tokens",
        "partial": f"NO feasible plan: offload all {p.groups} groups, evict all {p.evict_tokens} "
                   f"evictable tokens, and the rest stays short",
    }[p.action]
    rows = [f"site={s.site} gap={s.gap_tokens} tokens policy={policy} hit_rate={s.observed_hit_rate:g}",
            f"plan: {p.action}: {what}"]
    if s.tpot_guard_groups is not None and s.tpot_guard_groups < s.offload.headroom_groups:
        rows.append(f"TPOT guard: at most {s.tpot_guard_groups} of {s.offload.headroom_groups} headroom groups "
                    f"may be offloaded (--vamp-tpot-slo-ms)" + ("; offload ruled out" if not s.tpot_guard_groups
                                                               else ""))
    if s.host_load_us_per_token is not None:
        copies = sum(e.host_copy for e in s.evictable)
        rows.append(f"HiCache host copy: {copies} of {len(s.evictable)} candidates, priced at the load "
                    f"({s.host_load_us_per_token:g} us/token) in place of the re-prefill"
                    + ("; write-back: the others pay the write of their copy, then the same" if s.host_write_back
                       else ""))
    if s.dp_step is not None:
        rows.append(f"DP attention: {s.dp_step.offloaded_groups} groups offloaded here, at most "
                    f"{s.dp_step.peer_offloaded_groups} on another DP rank; C_e counts only groups above that")
    rows += ["", f"  {'action':<10} {'cost_s':>12}"]
    for key in COST_KEYS:
        cost = p.costs[key]
        mark = "  <- chosen" if key == p.action else ""
        rows.append(f"  {key:<10} {'infeasible' if cost is None else f'{cost:.6e}':>12}{mark}")
    return "\n".join(rows)


def explain(args: argparse.Namespace) -> int:
    try:
        record = _load_record(args.file, args.line)
        if isinstance(record, dict) and "restore_state" in record:
            return _explain_restore(record["restore_state"], args.json)
        is_log_record = isinstance(record, dict) and "snapshot" in record
        snapshot = Snapshot.from_json(record["snapshot"] if is_log_record else record)
    except (InputError, SnapshotError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policy = args.policy or (record.get("policy") if is_log_record else None) or "cost"
    if policy not in POLICIES:
        print(f"error: record policy must be one of {', '.join(POLICIES)} (got {policy!r})", file=sys.stderr)
        return 2
    p = plan(snapshot, Coefficients(), policy)
    print(json.dumps(p.to_json()) if args.json else _describe(p, snapshot, policy))
    return 0


def _explain_restore(state: Any, as_json: bool) -> int:
    """A restore record: replay `plan_restore` on its logged state."""
    try:
        restore_plan = plan_restore(RestoreState(**state))
    except TypeError as e:
        raise InputError(f"restore_state does not match the format: {e}") from None
    out = restore_plan.to_json()
    print(json.dumps(out) if as_json else f"restore: {out['action']} ({out['groups']} groups, evict "
                                         f"{out['evict_tokens']} tokens, compact {out['compact']}): {out['reason']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vamp_sglang.policy",
                                     description="VAMP cost model and planner (paper section IV-B)")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("explain", help="print the plan and the four cost estimates for a snapshot")
    ex.add_argument("file", help="a snapshot JSON file, or a JSONL decision log")
    ex.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    ex.add_argument("--line", type=int, default=None, help="1-based record of a JSONL log (default: last)")
    ex.add_argument("--policy", choices=POLICIES, default=None,
                    help="replay under this policy (default: the record's, else cost)")
    args = parser.parse_args(argv)
    return explain(args)


if __name__ == "__main__":
    sys.exit(main())
