"""A deterministic random-weight MoE checkpoint that SGLang 0.5.23 serves, for tests, CI and the demo.

    python -m vamp_sglang.tiny_moe OUT_DIR [--arch ARCH] [--seed N] [--quant fp8]
        [--eagle3-draft DRAFT_DIR] [--agreeing-draft AGREE_DIR] [--routing-from NPZ] [--wrapper WRAP_DIR]

Prints one line: the arch, parameter count, vocab and the sizes VAMP trades (experts per layer, KV per
token, and whatever else the family records). A spec that fails its checks is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vamp_sglang.tiny_moe.agreeing_draft import write_agreeing_draft
from vamp_sglang.tiny_moe.checkpoint import (
    ARCHS,
    DEFAULT_ARCH,
    FAMILIES,
    read_manifest,
    spec_for,
    write_checkpoint,
)
from vamp_sglang.tiny_moe.common import QUANTS
from vamp_sglang.tiny_moe.eagle3 import write_eagle3_draft
from vamp_sglang.tiny_moe.fp8 import FP8_INTERMEDIATE
from vamp_sglang.tiny_moe.qwen3_5_moe import WRAPPER_ARCHITECTURE, write_wrapper
from vamp_sglang.tiny_moe.routing import trace_geometry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vamp_sglang.tiny_moe",
                                     description=__doc__.splitlines()[0])
    defaults = FAMILIES[DEFAULT_ARCH]()
    other_layers = ", ".join(f"{arch}: {family().layers}" for arch, family in FAMILIES.items()
                             if family().layers != defaults.layers)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--layers", type=int, default=None,
                        help=f"default {defaults.layers}" + (f" ({other_layers})" if other_layers else ""))
    parser.add_argument("--experts", type=int, default=None,
                        help=f"default {defaults.experts}, or the --routing-from trace's")
    parser.add_argument("--top-k", type=int, default=None, help=f"default {defaults.top_k}, or the trace's")
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--intermediate", type=int, default=None,
                        help=f"default {defaults.intermediate}; {FP8_INTERMEDIATE} with --quant fp8 (the same bytes "
                             f"per expert, so the same expert groups)")
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--quant", choices=QUANTS, default=defaults.quant,
                        help="fp8: block-quantised FP8 projections, with the bf16 source in OUT_DIR/bf16")
    parser.add_argument("--eagle3-draft", type=Path, default=None, metavar="DRAFT_DIR",
                        help="also write an EAGLE3 draft of the checkpoint there (--arch qwen3_moe)")
    parser.add_argument("--agreeing-draft", type=Path, default=None, metavar="AGREE_DIR",
                        help="also write the checkpoint there with an MTP draft that agrees with the target "
                             "(--arch deepseek_v3 or qwen3_next; agreeing_draft.py)")
    parser.add_argument("--routing-from", type=Path, default=None, metavar="NPZ",
                        help="fit the routers to route like this routing trace (routing-data format; routing.py)")
    parser.add_argument("--wrapper", type=Path, default=None, metavar="WRAP_DIR",
                        help=f"also write the checkpoint there as {WRAPPER_ARCHITECTURE} (--arch qwen3_5_moe)")
    args = parser.parse_args(argv)
    fields = {k: v for k, v in vars(args).items()
              if k not in ("out_dir", "eagle3_draft", "agreeing_draft", "routing_from", "wrapper") and v is not None}
    if args.routing_from is not None and args.routing_from.is_file():
        fields = trace_geometry(args.routing_from) | fields
    if args.quant == "fp8" and args.intermediate is None:
        fields["intermediate"] = FP8_INTERMEDIATE
    start_s = time.perf_counter()
    try:
        spec = spec_for(**fields)
        out = write_checkpoint(args.out_dir, spec, args.routing_from)
        if args.eagle3_draft is not None:
            write_eagle3_draft(out, args.eagle3_draft)
        if args.agreeing_draft is not None:
            write_agreeing_draft(out, args.agreeing_draft)
        if args.wrapper is not None:
            write_wrapper(out, args.wrapper)
    except ValueError as exc:
        parser.error(str(exc))
    manifest = read_manifest(out)
    expert_bytes = manifest["expert_bytes_per_layer"]
    print(
        f"{out}: {manifest['spec']['arch']} seed={manifest['spec']['seed']} "
        f"params={manifest['params'] / 1e6:.1f}M vocab={manifest['vocab_size']} "
        f"expert_bytes_per_layer={expert_bytes} ({expert_bytes / 2**20:.1f} MiB) "
        f"kv_bytes_per_token={manifest['kv_bytes_per_token']} "
        + "".join(f"{key}={manifest[key]} " for key in spec.manifest_extras())
        + f"({time.perf_counter() - start_s:.1f}s)"
    )


if __name__ == "__main__":
    main()
