"""`python -m eval.bench --url URL --workload {multiturn,trace} [--trace FILE] [--sessions C] [--out FILE.json]`

Replays a workload against a running server in closed loop, and writes one JSON with client-side
TTFT/TPOT (steady state, section VI-A), throughput, the server's cache hit rate and preemptions from
its counters, a digest of every generated token (equal digests = identical greedy outputs), and the
`/vamp/stats` snapshots before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from eval import client, server_metrics
from eval.multiturn import MultiTurnSpec, add_shape_args, generate_multiturn, spec_from_args
from eval.replay import Replayer, ReplayOptions
from eval.stats import RequestRecord, summarize
from eval.synth import TokenSpace
from eval.trace_format import TraceRequest, load_trace, scale_request


@dataclass(frozen=True)
class BenchSpec:
    """Everything one bench run needs besides the server; runners build these directly."""

    workload: str = "multiturn"
    trace: str | None = None
    scale: float = 1.0
    max_requests: int | None = None
    multiturn: MultiTurnSpec = field(default_factory=MultiTurnSpec)
    vocab_size: int | None = None
    keep_requests: bool = True


def build_trace(spec: BenchSpec) -> list[TraceRequest]:
    if spec.workload == "multiturn":
        trace = generate_multiturn(spec.multiturn)
    elif spec.workload == "trace":
        if spec.trace is None:
            raise ValueError("--workload trace needs --trace FILE (make one with python -m eval.make_trace)")
        trace = load_trace(spec.trace)
    else:
        raise ValueError(f"--workload must be multiturn or trace (got {spec.workload!r})")
    if spec.max_requests is not None:
        trace = trace[: spec.max_requests]
    return [scale_request(r, spec.scale) for r in trace] if spec.scale != 1.0 else trace


async def _model_info(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/model_info") as response:
        response.raise_for_status()
        return await response.json()


def _vocab_size(info: dict[str, Any]) -> int:
    config = Path(str(info.get("model_path", ""))) / "config.json"
    if not config.is_file():
        raise ValueError(f"cannot read the vocabulary size from {config}: pass --vocab-size")
    data = json.loads(config.read_text())
    vocab = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int):
        raise ValueError(  # noqa: TRY004  (a bad config file, reported like every other input error)
            f"{config} has no integer vocab_size: pass --vocab-size")
    return vocab


def _tokenizer(info: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer  # lazy: only the text APIs need it

    return AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info["model_path"])


async def run_bench(spec: BenchSpec, options: ReplayOptions,
                    records_out: list[list[RequestRecord]] | None = None) -> dict[str, Any]:
    """One run against a live server; returns the result dict that `--out` writes. `records_out`: this run's
    request records, output ids included (the JSON keeps only their digest), are appended to it."""
    trace = build_trace(spec)
    url = options.url
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        info = await _model_info(http, url)
        space = TokenSpace.for_vocab(spec.vocab_size or _vocab_size(info))
        tokenizer = _tokenizer(info) if options.api != "generate" else None
        before = await server_metrics.fetch_metrics(http, url)
        vamp_before = await server_metrics.fetch_vamp_stats(http, url)
        replayer = Replayer(trace, options, space, tokenizer)
        duration_s = await replayer.run(http)
        after = await server_metrics.fetch_metrics(http, url)
        vamp_after = await server_metrics.fetch_vamp_stats(http, url)
    records = replayer.records
    if records_out is not None:
        records_out.append(records)
    result: dict[str, Any] = summarize(records, duration_s) | server_metrics.counter_summary(before, after)
    if result["cache_hit_rate"] is None:  # server without --enable-metrics: fall back to usage reports
        result["cache_hit_rate"] = result["client_cache_hit_rate"]
    result |= {
        "vamp_stats_before": vamp_before, "vamp_stats_after": vamp_after,
        "model_path": info.get("model_path"), "url": url, "workload": spec.workload, "trace": spec.trace,
        "sessions": len(replayer.sessions),
        "scheduled_requests": len(trace), "options": asdict(options),
        "multiturn": asdict(spec.multiturn) if spec.workload == "multiturn" else None,
    }
    if spec.keep_requests:
        result["requests"] = [{k: v for k, v in asdict(r).items() if k not in ("output_ids", "output_text")}
                              for r in sorted(records, key=lambda r: r.start_s)]
    return result


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Workload flags shared by eval.bench and the runners."""
    parser.add_argument("--workload", choices=("multiturn", "trace"), default="multiturn")
    parser.add_argument("--trace", help="session-trace JSONL (see eval.trace_format) for --workload trace")
    parser.add_argument("--scale", type=float, default=1.0, help="scale trace token counts, e.g. 0.05")
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests of the trace")
    add_shape_args(parser)
    parser.add_argument("--vocab-size", type=int, help="default: read from the server model's config.json")
    parser.add_argument("--api", choices=client.API_MODES, default="generate")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival/think times")
    parser.add_argument("--max-duration-s", type=float, help="stop issuing new turns after this many seconds")
    parser.add_argument("--no-exact-output", dest="exact_output", action="store_false",
                        help="let answers stop at EOS (default: exactly --output-tokens / the trace's count)")
    parser.add_argument("--dp-sticky", type=int, default=0, metavar="N",
                        help="DP attention: keep each session on one of N DP ranks (routed_dp_rank by session hash)")
    parser.add_argument("--dp-rank", type=int, help="DP attention: send every session to this DP rank")


def specs_from_args(args: argparse.Namespace, url: str) -> tuple[BenchSpec, ReplayOptions]:
    mt = spec_from_args(args, args.sessions or MultiTurnSpec.sessions).validate()
    spec = BenchSpec(args.workload, args.trace, args.scale, args.max_requests, mt, args.vocab_size)
    options = ReplayOptions(url, args.api, max_sessions=args.sessions if args.workload == "trace" else None,
                            time_scale=args.time_scale, max_duration_s=args.max_duration_s,
                            exact_output=args.exact_output, progress=True, dp_sticky=args.dp_sticky,
                            dp_rank=args.dp_rank)
    return spec, options.validate()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--sessions", type=int, help="multiturn: sessions c; trace: max concurrent sessions")
    parser.add_argument("--out", help="write the result JSON here (default: print a summary only)")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    try:
        spec, options = specs_from_args(args, args.url.rstrip("/"))
        result = asyncio.run(run_bench(spec, options))
    except (ValueError, OSError, aiohttp.ClientError) as exc:
        parser.exit(2, f"error: {exc}\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    keys = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "cache_hit_rate", "preemptions",
            "outputs_digest")
    print(json.dumps({k: result[k] for k in keys}))


if __name__ == "__main__":
    main()
