"""Speculative decoding VAMP or CPU mode cannot serve, refused by the launcher before anything loads.

With VAMP on, the draft-model algorithms whose draft KV pools VAMP grows with the target's
(integration/memory/draft_pools.py) are served: EAGLE, its alias NEXTN (DeepSeek/GLM MTP layers) and
EAGLE3; a draft whose KV row differs from the target's is refused at scheduler start, where its pool exists.
The other draft algorithms are refused by name (`refused_with_vamp`): STANDALONE (a whole draft model),
DFLASH, DSPARK, UNO, FROZEN_KV_MTP and plugin-registered ones build pools or state VAMP does not lay out.
A hybrid model (Qwen3-Next) with any speculation stays refused by refusals/hybrid.py: its state pool's
per-draft-token tensors do not grow.

On `--device cpu` the EAGLE worker's attention is torch_native with the draft backends and target-verify
forward of `vamp_sglang.cpu.speculative`, which lay out draft chains only: a tree draft
(`--speculative-eagle-topk` above 1) needs the tree mask in the draft's decode steps and in the target's
verify, which torch_native does not apply. This holds with VAMP off too (ratio 0): the CPU path lacks it,
not VAMP. No SGLang import here: the launcher answers in a second.
"""

from __future__ import annotations

import argparse

from vamp_sglang.local_config import local_model_config

TOPK = "--speculative-eagle-topk"
# Algorithms whose draft pools grow with VAMP (SGLang's EAGLE worker; NEXTN is SGLang's alias of EAGLE).
SERVED_WITH_VAMP = ("EAGLE", "EAGLE3", "NEXTN")
# Targets for which SGLang picks a tree draft (top-k 4) when the flag is left out
# (arg_groups/speculative_hook.py _auto_choose_speculative_params; STANDALONE always gets top-k 1).
TREE_BY_DEFAULT = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The SGLang flag `refused` reads (`--speculative-algorithm` comes with the hybrid refusals' flags)."""
    parser.add_argument(TOPK, type=int, default=None)


def refused(sg: argparse.Namespace) -> str | None:
    """The refusal naming the flag, for a tree draft on CPU; or None."""
    topk = sg.speculative_eagle_topk
    algorithm = (sg.speculative_algorithm or "").upper()
    if (sg.device or "cuda") != "cpu" or not algorithm or topk == 1:
        return None
    if topk is None:
        if algorithm in ("NGRAM", "STANDALONE"):  # SGLang's auto-pick gives these no tree
            return None
        architectures = local_model_config(sg.model_path).get("architectures") or []
        if not set(architectures) & set(TREE_BY_DEFAULT):
            return None
        return (f"{TOPK} left out is not supported with --device cpu for {architectures[0]}: SGLang then "
                f"picks a tree draft (top-k 4), and CPU mode drafts chains only; pass {TOPK} 1")
    return (f"{TOPK} {topk} is not supported with --device cpu: CPU mode drafts chains "
            f"only (torch_native applies no tree mask); use {TOPK} 1")


def refused_with_vamp(algorithm: str | None) -> str | None:
    """Why VAMP cannot serve draft-model algorithm `algorithm` (a draft KV pool VAMP does not grow), or None."""
    name = (algorithm or "").upper()
    if not name or name in SERVED_WITH_VAMP:
        return None
    return (f"{name}'s draft KV pools or state are not laid out by VAMP, which grows the draft pools of "
            f"{', '.join(SERVED_WITH_VAMP)} only")
