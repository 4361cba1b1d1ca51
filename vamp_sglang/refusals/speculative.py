"""Speculative decoding VAMP or CPU mode cannot serve, refused by the launcher before anything loads.

With VAMP on, the draft-model algorithms whose draft KV pools VAMP grows with the target's
(integration/memory/draft_pools.py) are served: EAGLE, its alias NEXTN (DeepSeek/GLM MTP layers) and
EAGLE3. A draft whose KV row differs from the target's cannot grow with it (VAMP grows every pool by one row
count): the launcher refuses it from the two config.json files (`draft_row_refused`), and the scheduler-start guard
(draft_pools.lay_draft_pool) refuses what the launcher could not read, such as a draft named by its hub id.
The other draft algorithms are refused by name (`refused_with_vamp`): STANDALONE (a whole draft model),
DFLASH, DSPARK, UNO, FROZEN_KV_MTP and plugin-registered ones build pools or state VAMP does not lay out.
On a hybrid model (Qwen3-Next) refusals/hybrid.py serves its MTP draft (EAGLE, NEXTN) and refuses the rest:
the state pool's per-draft-token tensors are one row per running request, so they need no growth.

On `--device cpu` the EAGLE worker's attention is torch_native with the draft backends and target-verify
forward of `vamp_sglang.cpu.speculative`, which lay out draft chains only: a tree draft
(`--speculative-eagle-topk` above 1) needs the tree mask in the draft's decode steps and in the target's
verify, which torch_native does not apply. This holds with VAMP off too (ratio 0): the CPU path lacks it,
not VAMP. No SGLang import here: the launcher answers in a second.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from vamp_sglang.local_config import local_model_config

TOPK = "--speculative-eagle-topk"
DRAFT_PATH = "--speculative-draft-model-path"
# Algorithms whose draft pools grow with VAMP (SGLang's EAGLE worker; NEXTN is SGLang's alias of EAGLE).
SERVED_WITH_VAMP = ("EAGLE", "EAGLE3", "NEXTN")
# Targets for which SGLang picks a tree draft (top-k 4) when the flag is left out
# (arg_groups/speculative_hook.py _auto_choose_speculative_params; STANDALONE always gets top-k 1).
TREE_BY_DEFAULT = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The SGLang flags `refused` and `draft_row_refused` read (`--speculative-algorithm` comes with the hybrid
    refusals' flags, the parallel sizes with the attention refusals')."""
    parser.add_argument(TOPK, type=int, default=None)
    parser.add_argument(DRAFT_PATH, "--speculative-draft-model", dest="speculative_draft_model_path", default=None)


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


def draft_row_refused(sg: argparse.Namespace) -> str | None:
    """Why a local EAGLE/EAGLE3 draft cannot grow with the target (its KV row on one attention-TP rank differs
    from the target's), or None. SGLang gives the draft the target's attention-TP size
    (speculative/draft_parallel.py:71-76) and pool dtype, so the rows compare as elements: KV heads per rank x
    head size (heads replicated below the ranks), or MLA's latent. None when either config.json is not local."""
    draft = local_model_config(sg.speculative_draft_model_path)
    target = local_model_config(sg.model_path)
    target = target.get("text_config") or target
    if not draft or not target:
        return None
    attn_dp = sg.attn_dp_size if sg.attn_dp_size > 1 else (sg.dp_size if sg.enable_dp_attention else 1)
    attn_tp = max(1, sg.tp_size // max(1, attn_dp * sg.attn_cp_size))
    why = kv_row_mismatch(draft, target, attn_tp)
    return None if why is None else (f"{DRAFT_PATH} {sg.speculative_draft_model_path}: {why}; "
                                     "run with --vamp-max-offload-ratio 0")


def kv_row_mismatch(draft: Mapping[str, Any], target: Mapping[str, Any], attn_tp: int) -> str | None:
    """Why a draft of config `draft` cannot grow with a target of config `target` on `attn_tp` attention-TP
    ranks (their KV rows differ), or None: equal rows, or a row a config does not tell. The one rule the
    launcher and the capacity planner (capacity/draft.py) apply."""
    (draft_row, draft_says), (target_row, target_says) = _kv_row(draft, attn_tp), _kv_row(target, attn_tp)
    if draft_row is None or target_row is None or draft_row == target_row:
        return None
    return (f"the draft's KV row ({draft_says} on each of {attn_tp} attention-TP ranks) differs from the "
            f"target's ({target_says}), and VAMP grows both pools by one row count, which needs equal rows")


def _kv_row(config: Mapping[str, Any], attn_tp: int) -> tuple[int | None, str]:
    """(elements of one token's row in one KV buffer on one rank, how the config makes it); None: unknown."""
    if config.get("kv_lora_rank"):
        latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
        return latent, f"an MLA latent of {latent}"
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if not isinstance(heads, int) or heads < 1:
        return None, ""
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if not isinstance(head_dim, int):
        return None, ""
    kv_heads = max(1, int(config.get("num_key_value_heads") or heads) // attn_tp)
    return kv_heads * head_dim, f"{kv_heads} KV heads x {head_dim}"
