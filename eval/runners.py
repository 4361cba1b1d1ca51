"""`python -m eval.runners {ablation-ratio,ablation-policy,sweep-concurrency} [options]`

Runs one workload against each server configuration in turn (one server at a time, a fresh server per
run so no run inherits another's cache or grown pool) and writes one JSON per (configuration,
concurrency, repeat) under `results/<target>/`, then the figures (eval.plots).

- ablation-ratio: the baseline (ratio 0) and VAMP-10/15/20/25 (paper section VI-E).
- ablation-policy: the cost policy, evict-first, offload-first, and stock LRU (ratio 0).
- sweep-concurrency: c over a range that crosses the baseline's capacity, per ratio (Figure 9).
Defaults are sized for the tiny model on a 2-core CPU; `--model --device cuda --tp` run the same on GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from eval import plots
from eval.bench import BenchSpec, add_workload_args
from eval.multiturn import spec_from_args
from eval.replay import ReplayOptions
from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model

TINY_MODEL = "models/tiny-qwen3-moe"
BASELINE = ServerConfig("baseline", ("--vamp-max-offload-ratio", "0"))
# CPU defaults (tiny model, 2 cores): each target well under 30 minutes including server starts.
DEFAULT_RATIOS = {"ablation-ratio": "0.10,0.15,0.20,0.25", "ablation-policy": "",
                  "sweep-concurrency": "0.15,0.25"}
DEFAULT_CONCURRENCY = {"ablation-ratio": "12", "ablation-policy": "12", "sweep-concurrency": "2,4,8,12,16"}


def vamp(ratio: float, policy: str | None = None, name: str | None = None) -> ServerConfig:
    flags = ("--vamp-max-offload-ratio", f"{ratio:g}") + (("--vamp-policy", policy) if policy else ())
    return ServerConfig(name or f"vamp-{round(ratio * 100)}", flags)


@dataclass(frozen=True)
class Experiment:
    target: str
    configs: tuple[ServerConfig, ...]
    concurrencies: tuple[int, ...]


def experiments(ratios: list[float], concurrencies: list[int], policy_ratio: float) -> dict[str, Experiment]:
    top = max(concurrencies)
    return {
        "ablation-ratio": Experiment("ablation-ratio", (BASELINE, *(vamp(r) for r in ratios)), (top,)),
        "ablation-policy": Experiment("ablation-policy", (
            vamp(policy_ratio, "cost", "cost"), vamp(policy_ratio, "evict-first", "evict-first"),
            vamp(policy_ratio, "offload-first", "offload-first"), replace(BASELINE, name="stock-lru")), (top,)),
        "sweep-concurrency": Experiment("sweep-concurrency", (BASELINE, *(vamp(r) for r in ratios)),
                                        tuple(concurrencies)),
    }


def result_path(out_dir: Path, config: ServerConfig, concurrency: int, run: int) -> Path:
    return out_dir / f"{config.name}__c{concurrency}__r{run}.json"


def run_one(setup: ServerSetup, config: ServerConfig, spec: BenchSpec, options: ReplayOptions,
            concurrency: int, run: int, out_dir: Path) -> dict:
    from eval.bench import run_bench

    spec = replace(spec, multiturn=replace(spec.multiturn, sessions=concurrency))
    started = time.time()
    with Server(setup, config) as server:
        options = replace(options, url=server.url,
                          max_sessions=concurrency if spec.workload == "trace" else None)
        result = asyncio.run(run_bench(spec, options))
        log_path = str(server.log_path)
    result |= {"config": asdict(config), "concurrency": concurrency, "run": run, "server_log": log_path,
               "server_setup": asdict(setup), "started_unix_s": started}
    path = result_path(out_dir, config, concurrency, run)
    path.write_text(json.dumps(result, indent=1))
    return result


def run_experiment(experiment: Experiment, setup: ServerSetup, spec: BenchSpec, options: ReplayOptions,
                   runs: int, out_dir: Path, resume: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "experiment.json").write_text(json.dumps(
        {"experiment": asdict(experiment), "setup": asdict(setup), "bench": asdict(spec), "runs": runs}, indent=1))
    for concurrency in experiment.concurrencies:
        for config in experiment.configs:
            for run in range(runs):
                if resume and result_path(out_dir, config, concurrency, run).is_file():
                    continue
                result = run_one(setup, config, spec, options, concurrency, run, out_dir)
                print(f"[{experiment.target}] {config.name} c={concurrency} run={run}: "
                      f"ttft_p99={_fmt(result['ttft_p99_s'])}s hit={_fmt(result['cache_hit_rate'])} "
                      f"preempt={result['preemptions']} done={result['completed']} failed={result['failed']}",
                      flush=True)
    plots.render(out_dir)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.runners", description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=("ablation-ratio", "ablation-policy", "sweep-concurrency"))
    parser.add_argument("--model", default=TINY_MODEL, help=f"model path (default {TINY_MODEL}, made if missing)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=3072, help="the baseline KV pool, in tokens")
    parser.add_argument("--server-flags", default="", help="extra server flags, space-separated")
    parser.add_argument("--ratios", help="comma-separated offload ratios (default: per target)")
    parser.add_argument("--policy-ratio", type=float, default=0.15,
                        help="ablation-policy: a ratio too small for the load, so the policy must choose")
    parser.add_argument("--concurrency", help="comma-separated session counts (default: per target; the "
                        "ablations run at one concurrency past the baseline's capacity)")
    parser.add_argument("--runs", type=int, default=1, help="independent runs per point (paper: 5)")
    parser.add_argument("--out-dir", help="default results/<target>")
    parser.add_argument("--resume", action="store_true", help="skip points whose JSON exists")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    add_workload_args(parser)
    parser.set_defaults(first_turn_tokens=256, turn_growth_tokens=64, output_tokens=16, block_tokens=32)
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in _floats(args.concurrency or DEFAULT_CONCURRENCY[args.target])]
    ratios = _floats(args.ratios or DEFAULT_RATIOS[args.target])
    if args.model == TINY_MODEL and args.device == "cpu":
        ensure_tiny_model(args.model)
    out_dir = Path(args.out_dir or f"results/{args.target}")
    setup = ServerSetup(args.model, args.device, args.max_total_tokens, args.tp, tuple(args.server_flags.split()),
                        args.startup_timeout_s, str(out_dir / "logs"))
    mt = spec_from_args(args, sessions=1).validate()
    spec = BenchSpec(args.workload, args.trace, args.scale, args.max_requests, mt, args.vocab_size)
    options = ReplayOptions("", args.api, time_scale=args.time_scale, max_duration_s=args.max_duration_s,
                            exact_output=args.exact_output, dp_sticky=args.dp_sticky, dp_rank=args.dp_rank).validate()
    experiment = experiments(ratios, concurrencies, args.policy_ratio)[args.target]
    run_experiment(experiment, setup, spec, options, args.runs, out_dir, args.resume)


if __name__ == "__main__":
    main()
