"""`python -m vamp_sglang.capacity`: what each offload ratio buys and costs, before deploying.

    python -m vamp_sglang.capacity --model PATH_OR_NAME --gpu-mem-gib G --tp N [--dp D] [--ep E] [--mem-fraction F]
        [--h2d-gbps B] [--decode-ms D] [--trace FILE] [--ratios 0.1,0.15,...] [--json]
        [--speculative-algorithm NEXTN|EAGLE|EAGLE3 [--speculative-draft-model-path DRAFT]]

Every flag is checked before anything is read; a bad one exits with status 2 and names it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from vamp_sglang.capacity.draft import ALGORITHM, ALGORITHMS, DRAFT_PATH, DRAFTS, check_flags
from vamp_sglang.capacity.models import ModelConfigError, config_dtype, load_model_config
from vamp_sglang.capacity.plan import CapacityError, CapacityModel, Deployment
from vamp_sglang.capacity.report import build_report, format_table
from vamp_sglang.memory.geometry import DTYPE_BYTES, GeometryError
from vamp_sglang.memory.layout import LayoutError

DEFAULT_RATIOS = "0.1,0.15,0.2,0.25"  # the ratios of the paper's ablation (VI-E)


def parse_ratios(text: str) -> dict[str, float]:
    """'0.15,0.2' -> {'0.15': 0.15, '0.2': 0.2}: keys exactly as written, each in [0, 1), no repeats."""
    ratios: dict[str, float] = {}
    for token in (t.strip() for t in text.split(",")):
        try:
            value = float(token)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{token!r} is not a number") from None
        if not (math.isfinite(value) and 0.0 <= value < 1.0):
            raise argparse.ArgumentTypeError(f"{token} must be in [0, 1)")
        if token in ratios or value in ratios.values():
            raise argparse.ArgumentTypeError(f"{token} is given twice")
        ratios[token] = value
    return ratios


def _number(kind: type, low: float, low_open: bool, high: float | None = None):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or (high and value > high):
            bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high else "")
            raise argparse.ArgumentTypeError(f"{text} must be {bound}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vamp_sglang.capacity", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="config.json, a directory holding one, or a built-in name")
    p.add_argument("--gpu-mem-gib", type=_number(float, 0, True), required=True, help="memory of one GPU, GiB")
    p.add_argument("--tp", type=_number(int, 1, False), required=True, help="tensor-parallel degree")
    p.add_argument("--dp", type=_number(int, 1, False), default=1,
                   help="DP attention degree (SGLang --enable-dp-attention --dp-size D; default 1: none)")
    p.add_argument("--dp-attention", action="store_true",
                   help="DP attention with attention-TP 1, the DeepSeek/Kimi preset: --dp equal to --tp")
    p.add_argument("--ep", type=_number(int, 1, False), default=1,
                   help="expert parallelism (SGLang --ep-size E, standard dispatcher): each rank holds E_routed / E "
                        "experts, split over tp / E ranks (default 1: none)")
    p.add_argument("--mem-fraction", type=_number(float, 0, True, 1.0), default=0.9,
                   help="share of GPU memory for weights and KV pool (SGLang --mem-fraction-static; default 0.9)")
    p.add_argument("--h2d-gbps", type=_number(float, 0, True), default=50.0,
                   help="host-to-device bandwidth per GPU in GB/s (default 50: PCIe 5.0 x16, pinned)")
    p.add_argument("--decode-ms", type=_number(float, 0, False), default=0.0,
                   help="decode step time with every expert resident (default 0)")
    p.add_argument("--trace", help="a session trace (eval/trace_format.py) whose sessions the pools must hold")
    p.add_argument("--ratios", type=parse_ratios, default=parse_ratios(DEFAULT_RATIOS),
                   help=f"comma-separated offload ratios (default {DEFAULT_RATIOS})")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="weight and KV dtype (default: the config's)")
    p.add_argument("--page-size", type=_number(int, 1, False), default=1, help="SGLang --page-size (tokens)")
    p.add_argument("--max-total-tokens", type=_number(int, 1, False), help="SGLang --max-total-tokens")
    p.add_argument("--kv-pool-gib", type=_number(float, 0, True),
                   help="a measured start-up KV pool per GPU (GiB) instead of the estimate")
    p.add_argument("--hicache-gib", type=_number(float, 0, True),
                   help="HiCache host KV pool per GPU (GiB): adds host tokens and the host link's two costs")
    p.add_argument(ALGORITHM, type=str.upper, choices=ALGORITHMS,
                   help="speculative decoding as SGLang's flag: the draft's KV rows and weights count (NEXTN, or "
                        "EAGLE without a draft path: the model's MTP layers)")
    p.add_argument(DRAFT_PATH, help="the EAGLE/EAGLE3 draft's config.json, a directory holding one, or a built-in "
                                    f"draft ({', '.join(DRAFTS)})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _dp(args: argparse.Namespace) -> int:
    if args.dp_attention and args.dp not in (1, args.tp):
        raise CapacityError(f"--dp-attention means --dp {args.tp} (attention-TP 1); drop one of them "
                            f"(got --dp {args.dp})")
    return args.tp if args.dp_attention else args.dp


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_flags(args.speculative_algorithm, args.speculative_draft_model_path)
        if args.speculative_algorithm and args.hicache_gib is not None:
            raise CapacityError(f"--hicache-gib with {ALGORITHM} is not planned: the host pool's draft rows are "
                                "not priced")
        name, config = load_model_config(args.model)
        deployment = Deployment(
            gpu_mem_gib=args.gpu_mem_gib, tp=args.tp, dp=_dp(args), ep=args.ep, dtype=args.dtype or config_dtype(config),
            mem_fraction=args.mem_fraction, h2d_gbps=args.h2d_gbps, decode_ms=args.decode_ms,
            page_size=args.page_size, max_total_tokens=args.max_total_tokens, kv_pool_gib=args.kv_pool_gib,
            speculative_algorithm=args.speculative_algorithm, draft_model_path=args.speculative_draft_model_path)
        model = CapacityModel.build(config, deployment)
        sessions = None
        if args.trace:
            from vamp_sglang.capacity.sessions import load_footprints

            sessions = load_footprints(args.trace)
    except (ModelConfigError, GeometryError, LayoutError, CapacityError, OSError, ValueError) as exc:
        parser.error(str(exc))
    report = build_report(name, model, args.ratios, args.trace, sessions)
    if args.hicache_gib is not None:
        from vamp_sglang.capacity.hicache import format_hicache, hicache_report

        report["hicache"] = hicache_report(model, args.ratios, args.hicache_gib)
    text = format_table(report) + ("\n".join(["", *format_hicache(report["hicache"])]) if "hicache" in report else "")
    print(json.dumps(report, indent=2) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
