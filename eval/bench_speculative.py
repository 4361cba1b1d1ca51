"""`python -m eval.bench_speculative {deepseek,qwen3} [--only NAME,...] [--out-dir DIR] [--summarize-only]`

The acceptance bench of speculative decoding with VAMP (issue 46, docs/speculative.md): the multi-turn
workload past the cliff (`eval.bench --workload multiturn --sessions 8`) against three servers, one at a time,
back to back:
- `ratio0-spec`: ratio 0 with the draft on the small pool (SGLang alone, evicting and re-prefilling);
- `vamp20-spec`: VAMP-20 with the same draft on the same pool (the pools grow from expert memory);
- `ratio0-large`: ratio 0 without speculation on a pool where nothing is evicted (the reference outputs).
Models: `deepseek` is the tiny DeepSeek-V3 whose MTP layer is built to agree with the target (EAGLE);
`qwen3` the tiny Qwen3-MoE with its EAGLE3 draft (random weights, accept length about 1).

Every server logs each decode step (`--decode-log-interval 1`): SGLang's "Decode batch" line gives the
running batch, the tokens it holds, the accept length and the step's throughput. A step's wall time is its
generated tokens (running requests x accept length) over that throughput; it is kept only where no prefill
ran since the previous decode step, so it is the step itself. A request's TPOT is then about
(step wall time) / (accept length) plus the prefills that ran between its steps: `decode_steps` and
`tpot_split` in the summary split TPOT into those parts, and `prefill_s_estimate` is the time of the gaps that
held a prefill, less a step each (every running request waits through it); `tpot_split.png` draws the split
for every model summarised under --out-dir. The load average is taken before and after each run
(the machine may be shared). Writes `<model>.json` (the summary) under --out-dir, and each run's full
`eval.bench` JSON and server log under `raw/<model>/` and `logs/<model>/` beside it (the run names repeat
across models).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.servers import ServerConfig, ServerSetup

MODELS_DIR = Path("models")
CHAIN = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")
STEP_LOG = ("--decode-log-interval", "1")
SESSIONS = 8
MODELS = ("deepseek", "qwen3")  # the summaries `--out-dir` holds (other JSON there is not a model's)
POOL_TOKENS, LARGE_POOL_TOKENS = 4096, 32768
_LINE = re.compile(r"^\[[^\]]+\] (Prefill|Decode) batch, (.*)$")
_FIELD = re.compile(r"([#a-z][a-z \-()/]*): ([0-9.]+)")


@dataclass(frozen=True)
class DecodeStep:
    """One decode step as SGLang logs it at --decode-log-interval 1."""

    running: int
    kv_tokens: int
    accept_length: float  # tokens a request gains per step (1.0 without speculation)
    tokens_per_s: float
    after_prefill: bool  # a prefill ran since the previous decode step: the gap holds it too

    @property
    def wall_s(self) -> float:
        """The step's wall time: its generated tokens over SGLang's throughput for the gap."""
        return self.running * self.accept_length / self.tokens_per_s if self.tokens_per_s > 0 else float("nan")


def parse_steps(log_text: str) -> list[DecodeStep]:
    """Every decode step of a server log, in order; the first one (no gap before it) is left out."""
    steps, prefill_seen, first = [], False, True
    for line in log_text.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        if match.group(1) == "Prefill":
            prefill_seen = True
            continue
        fields = {k.strip(): float(v) for k, v in _FIELD.findall(match.group(2))}
        if not first:
            steps.append(DecodeStep(int(fields["#running-req"]), int(fields["#token"]),
                                    fields.get("accept len", 1.0), fields["gen throughput (token/s)"],
                                    prefill_seen))
        first, prefill_seen = False, False
    return steps


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_steps(steps: list[DecodeStep]) -> dict[str, Any]:
    """Batch size and per-step cost over the decode steps with no prefill in their gap.

    `wall_s_per_request` and `wall_ms_per_kv_token` normalise the step wall time by the running batch and by
    the tokens its requests hold, so two runs whose batches differ compare like with like."""
    pure = [s for s in steps if not s.after_prefill and s.tokens_per_s > 0]
    after_prefill = [s.wall_s for s in steps if s.after_prefill and s.tokens_per_s > 0]
    by_batch: dict[int, list[float]] = {}
    for step in pure:
        by_batch.setdefault(step.running, []).append(step.wall_s)
    pure_mean = _mean([s.wall_s for s in pure]) or 0.0
    return {
        "pure_wall_s_total": sum(s.wall_s for s in pure),
        # the gaps that held a prefill, less a pure step each: the prefills' time, the decode stalled meanwhile
        "prefill_s_estimate": sum(after_prefill) - pure_mean * len(after_prefill),
        "steps": len(steps), "pure_steps": len(pure),
        "running_mean": _mean([s.running for s in steps]),
        "kv_tokens_mean": _mean([s.kv_tokens for s in steps]),
        "accept_length_mean": _mean([s.accept_length for s in steps]),
        "pure_wall_s_mean": _mean([s.wall_s for s in pure]),
        "pure_wall_s_per_request": _mean([s.wall_s / s.running for s in pure]),
        "pure_wall_ms_per_kv_token": _mean([1e3 * s.wall_s / s.kv_tokens for s in pure if s.kv_tokens]),
        "pure_wall_s_by_running": {str(n): round(statistics.fmean(w), 4) for n, w in sorted(by_batch.items())},
    }


def tpot_split(result: dict[str, Any], steps: dict[str, Any]) -> dict[str, Any]:
    """TPOT as (a step's own cost per token) plus what else a request waits for between its tokens."""
    wall, accept = steps["pure_wall_s_mean"], steps["accept_length_mean"]
    per_token = wall / accept if wall is not None and accept else None
    tpot = result["tpot_mean_s"]
    return {"tpot_mean_s": tpot, "decode_step_s_per_token": per_token,
            "other_s_per_token": None if per_token is None or tpot is None else tpot - per_token}


def configs(speculation: tuple[str, ...]) -> dict[str, tuple[int, ServerConfig]]:
    """The three servers of one model, by name: (pool tokens, configuration)."""
    return {
        "ratio0-spec": (POOL_TOKENS, ServerConfig("ratio0-spec", ("--vamp-max-offload-ratio", "0", *speculation,
                                                                  *CHAIN, *STEP_LOG))),
        "vamp20-spec": (POOL_TOKENS, ServerConfig("vamp20-spec", ("--vamp-max-offload-ratio", "0.2", *speculation,
                                                                  *CHAIN, *STEP_LOG))),
        "ratio0-large": (LARGE_POOL_TOKENS, ServerConfig("ratio0-large", ("--vamp-max-offload-ratio", "0",
                                                                          *STEP_LOG))),
    }


def prepare_model(model: str) -> tuple[Path, tuple[str, ...]]:
    """The checkpoint (written once under models/) and the speculation flags that serve its draft."""
    from vamp_sglang.tiny_moe.checkpoint import make_checkpoint

    if model == "deepseek":
        from vamp_sglang.tiny_moe.agreeing_draft import write_agreeing_draft

        path = MODELS_DIR / "tiny-deepseek-v3-agree"
        if not (path / "config.json").is_file():
            write_agreeing_draft(make_checkpoint(MODELS_DIR / "tiny-deepseek-v3", arch="deepseek_v3"), path)
        return path, ("--speculative-algorithm", "EAGLE")
    from vamp_sglang.tiny_moe.eagle3 import write_eagle3_draft

    target = make_checkpoint(MODELS_DIR / "tiny-qwen3-moe", arch="qwen3_moe")
    draft = MODELS_DIR / "tiny-qwen3-moe-eagle3-draft"
    if not (draft / "config.json").is_file():
        write_eagle3_draft(target, draft)
    return target, ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft))


def run_summary(result: dict[str, Any], pool: int) -> dict[str, Any]:
    """The figures the docs table needs from one run's `eval.bench` result and its server log."""
    after = result.get("vamp_stats_after") or {}
    steps = summarize_steps(parse_steps(Path(result["server_log"]).read_text(errors="replace")))
    staging = after.get("staging") or {}
    keys = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "output_tokens_per_s",
            "request_throughput", "cache_hit_rate", "preemptions", "outputs_digest", "duration_s")
    return {k: result.get(k) for k in keys} | {
        "pool_tokens_start": pool, "kv_pool_tokens_end": (after.get("kv_pool") or {}).get("tokens", pool),
        "draft_pool_tokens_end": [p["tokens"] for p in after.get("draft_pools") or []],
        "speculation": after.get("speculation"), "decisions": after.get("decisions"),
        "staged_bytes": staging.get("bytes"), "staging_copy_s": staging.get("copy_s"),
        "decode_steps": steps, "tpot_split": tpot_split(result, steps),
    }


def plot_tpot_split(summaries: dict[str, dict[str, Any]], path: Path) -> None:
    """One bar per (model, run): TPOT as the decode step's own cost per token plus the rest (prefills run
    between a request's steps), labelled with the run's output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = [(f"{model} {name}", run) for model, runs in summaries.items() for name, run in runs.items()
            if run["tpot_split"]["decode_step_s_per_token"] is not None]
    labels, runs = [r[0] for r in rows], [r[1] for r in rows]
    step = [1e3 * r["tpot_split"]["decode_step_s_per_token"] for r in runs]
    other = [max(1e3 * r["tpot_split"]["other_s_per_token"], 0.0) for r in runs]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    ax.barh(labels, step, label="decode step / accept length")
    ax.barh(labels, other, left=step, label="rest (prefills between steps)")
    for y, (s_ms, o_ms, run) in enumerate(zip(step, other, runs, strict=True)):
        tokens_per_s = run.get("output_tokens_per_s")
        if tokens_per_s is not None:
            ax.text(s_ms + o_ms, y, f" {tokens_per_s:.1f} tok/s", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("TPOT (ms)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_speculative", description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--only", help="comma-separated run names (default: all three, in order)")
    parser.add_argument("--out-dir", default="results/speculative")
    parser.add_argument("--summarize-only", action="store_true",
                        help="rebuild the summary from the runs under --out-dir/raw, starting no server")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else ["ratio0-spec", "vamp20-spec", "ratio0-large"]
    unknown = sorted(set(names) - set(configs(())))
    if unknown:
        parser.exit(2, f"error: --only names unknown runs {unknown}; known: {sorted(configs(()))}\n")
    from eval.bench import BenchSpec
    from eval.replay import ReplayOptions
    from eval.runners import run_one

    out = Path(args.out_dir)
    raw_dir, log_dir = out / "raw" / args.model, out / "logs" / args.model
    raw_dir.mkdir(parents=True, exist_ok=True)
    summary_path = out / f"{args.model}.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    model, speculation = (None, ()) if args.summarize_only else prepare_model(args.model)
    for name in names:
        pool, config = configs(speculation)[name]
        raw = raw_dir / f"{name}__c{SESSIONS}__r0.json"
        if args.summarize_only:
            if not raw.is_file():
                continue
            summary[name] = summary.get(name, {}) | run_summary(json.loads(raw.read_text()), pool)
        else:
            setup = ServerSetup(str(model), max_total_tokens=pool, log_dir=str(log_dir))
            load = os.getloadavg()[0]
            result = run_one(setup, config, BenchSpec(), ReplayOptions(url=""), SESSIONS, 0, raw_dir)
            summary[name] = run_summary(result, pool) | {
                "flags": list(config.flags), "load_avg_1m_before": load, "load_avg_1m_after": os.getloadavg()[0]}
        summary_path.write_text(json.dumps(summary, indent=1))
        print(name, json.dumps(summary[name]), flush=True)
    models = {m: json.loads((out / f"{m}.json").read_text()) for m in MODELS if (out / f"{m}.json").is_file()}
    plot_tpot_split(models, out / "tpot_split.png")


if __name__ == "__main__":
    main()
