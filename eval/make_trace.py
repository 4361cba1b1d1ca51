"""`python -m eval.make_trace {mooncake,sweagent,multiturn} --out FILE.jsonl [options]`

Converts a public trace (read in place from ../shared/traces or $VAMP_TRACES_DIR) or generates the
multi-turn workload into the session-trace format, so every replay goes through one client.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from eval.mooncake import import_mooncake
from eval.multiturn import MultiTurnSpec, add_shape_args, generate_multiturn, spec_from_args
from eval.sweagent import import_sweagent
from eval.trace_format import TraceRequest, dump_trace, scale_request, traces_dir

MOONCAKE_FILE = "mooncake_conversation_trace.jsonl"
SWEAGENT_DIR = "sweagent_demonstrations"


def _source(args: argparse.Namespace) -> list[TraceRequest]:
    if args.source == "multiturn":
        return generate_multiturn(spec_from_args(args, args.sessions))
    root = Path(args.input) if args.input else traces_dir()
    if args.source == "mooncake":
        path = root / MOONCAKE_FILE if root.is_dir() else root
        return import_mooncake(path, args.max_requests)
    if not args.model_path:
        raise ValueError("sweagent needs --model-path (its tokenizer defines the token counts)")
    from transformers import AutoTokenizer  # lazy: heavy

    folder = root / SWEAGENT_DIR if (root / SWEAGENT_DIR).is_dir() else root
    paths = sorted(folder.glob("*.traj"))
    if not paths:
        raise ValueError(f"no .traj files under {folder}")
    return import_sweagent(paths, AutoTokenizer.from_pretrained(args.model_path), args.block_tokens)


def describe(requests: list[TraceRequest]) -> str:
    turns = collections.Counter(r.session for r in requests)
    inputs = sorted(r.input_tokens for r in requests)
    return (f"{len(requests)} requests, {len(turns)} sessions (max {max(turns.values())} turns), "
            f"input tokens p50 {inputs[len(inputs) // 2]} max {inputs[-1]}, "
            f"output tokens mean {sum(r.output_tokens for r in requests) / len(requests):.0f}")


def main(argv: list[str] | None = None) -> None:
    d = MultiTurnSpec()
    parser = argparse.ArgumentParser(prog="python -m eval.make_trace", description=__doc__.splitlines()[0])
    parser.add_argument("source", choices=("mooncake", "sweagent", "multiturn"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--input", help="trace file or folder (default: the shared traces folder)")
    parser.add_argument("--model-path", help="sweagent: the served model (its tokenizer)")
    parser.add_argument("--scale", type=float, default=1.0, help="scale token counts, e.g. 0.05 for CPU")
    parser.add_argument("--max-requests", type=int)
    parser.add_argument("--sessions", type=int, default=d.sessions)
    add_shape_args(parser)
    args = parser.parse_args(argv)
    try:
        requests = _source(args)[: args.max_requests]
        if args.scale != 1.0:
            requests = [scale_request(r, args.scale) for r in requests]
        dump_trace(requests, args.out)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"error: {exc}\n")
    print(f"{args.out}: {describe(requests)}")


if __name__ == "__main__":
    main()
