"""Speculative decoding CPU mode cannot serve, refused by the launcher before anything loads.

On `--device cpu` the EAGLE worker's attention is torch_native with the draft backends and target-verify
forward of `vamp_sglang.cpu.speculative`, which lay out draft chains only: a tree draft
(`--speculative-eagle-topk` above 1) needs the tree mask in the draft's decode steps and in the target's
verify, which torch_native does not apply. This holds with VAMP off too (ratio 0): the CPU path lacks it,
not VAMP. No SGLang import here: the launcher answers in a second.
"""

from __future__ import annotations

import argparse

TOPK = "--speculative-eagle-topk"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The SGLang flag `refused` reads (`--speculative-algorithm` comes with the hybrid refusals' flags)."""
    parser.add_argument(TOPK, type=int, default=None)


def refused(sg: argparse.Namespace) -> str | None:
    """The refusal naming the flag, for a tree draft on CPU; or None."""
    topk = sg.speculative_eagle_topk
    if (sg.device or "cuda") != "cpu" or not sg.speculative_algorithm or topk in (None, 1):
        return None
    return (f"{TOPK} {topk} is not supported with --device cpu: CPU mode drafts chains "
            f"only (torch_native applies no tree mask); use {TOPK} 1")
