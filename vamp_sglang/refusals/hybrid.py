"""Hybrid-model (Qwen3-Next) configurations VAMP refuses, named once for the launcher and the scheduler,
and the state strategy it asks for when none is given (`vamp_defaults`).

A configuration is caught in one of two places, with the same words. The launcher sees only the flags
and the model's config.json, so it refuses what a flag names explicitly before anything loads
(`refused_by_flags`). What SGLang resolves itself is known only once its pools exist (the `auto` state
strategy becoming extra_buffer with the overlap scheduler on a GPU, a QSA pool chosen from the model, an
MLA or quantised full-attention pool), so `vamp_sglang.integration.memory.hybrid.check_supported` inspects the
built objects at scheduler start. No SGLang import here: the launcher must answer in about a second.
"""

from __future__ import annotations

import argparse

from vamp_sglang.local_config import local_model_config

FEATURES = {
    "pool": "needs HybridLinearKVPool; drop --enable-unified-memory",
    "full_attention": "a full-attention pool other than MHATokenToKVPool (MLA, DSA or quantised KV)",
    "extra_buffer": "the extra_buffer state strategy (pass --mamba-radix-cache-strategy no_buffer)",
    "int8_checkpoints": "int8 state checkpoints (drop --enable-int8-mamba-checkpoint)",
    "replayssm": "ReplaySSM state rings (drop --enable-linear-replayssm and --enable-linear-replayssm-spec)",
    "speculative": "a draft other than the model's own MTP layer (EAGLE or NEXTN), which VAMP has not served on "
                   "a hybrid model (drop --speculative-algorithm or use NEXTN)",
    "draft_path": "--speculative-draft-model-path names a draft other than a Qwen3-Next checkpoint, whose MTP "
                  "layer SGLang loads (configs/model_config.py:1134-1136); VAMP serves only that draft on a hybrid "
                  "model (drop --speculative-draft-model-path or name the model's own checkpoint)",
}
# The speculation VAMP serves on a hybrid model: the MTP draft (SGLang's EAGLE worker; NEXTN is its alias). Its
# per-draft-token state (MambaPool's intermediate_ssm / intermediate_conv_window) is one row per running
# request (mem_cache/kv_cache_configurator.py:1718-1721, layers/attention/linear/utils.py:125-155), not per
# state slot, so a state pool grown in slots needs no more of it (integration/memory/state_pool.py).
MTP_DRAFTS = ("EAGLE", "NEXTN")
MTP_SOURCE_ARCHS = ("Qwen3NextForCausalLM",)  # a draft checkpoint SGLang turns into Qwen3NextForCausalLMMTP


def message(feature: str, seen: str = "") -> str:
    """The refusal for one key of FEATURES; `seen` names what was found (a pool class) when known."""
    what = f"{seen} ({FEATURES[feature]})" if seen else FEATURES[feature]
    return f"VAMP does not support this hybrid model configuration: {what}; run with --vamp-max-offload-ratio 0"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The SGLang flags `refused_by_flags` reads, for the launcher's SGLang-free view of the argv."""
    for flag in ("--enable-unified-memory", "--enable-int8-mamba-checkpoint", "--enable-linear-replayssm",
                 "--enable-linear-replayssm-spec"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--mamba-radix-cache-strategy", default=None)
    parser.add_argument("--speculative-algorithm", default=None)  # --speculative-draft-model-path: speculative.py


def refused_by_flags(sg: argparse.Namespace) -> str | None:
    """The refusal for the first unsupported feature the flags name explicitly, or None."""
    named = [
        ("pool", sg.enable_unified_memory),
        ("extra_buffer", (sg.mamba_radix_cache_strategy or "").startswith("extra_buffer")),
        ("int8_checkpoints", sg.enable_int8_mamba_checkpoint),
        ("replayssm", sg.enable_linear_replayssm or sg.enable_linear_replayssm_spec),
        ("speculative", (sg.speculative_algorithm or "").upper() not in ("", *MTP_DRAFTS)),
        ("draft_path", bool(sg.speculative_algorithm) and _other_draft(sg.model_path, sg.speculative_draft_model_path)),
    ]
    return next((message(feature) for feature, on in named if on), None)


def _other_draft(model_path: str | None, draft_path: str | None) -> bool:
    """Whether a local draft checkpoint is something other than the model's MTP source; a hub name is left to
    the scheduler-start guard (integration/memory/draft_pools.py)."""
    if draft_path in (None, model_path):
        return False
    archs = local_model_config(draft_path).get("architectures")
    return bool(archs) and archs[0] not in MTP_SOURCE_ARCHS


def vamp_defaults() -> list[str]:
    """SGLang flags for a hybrid model with VAMP on, each unless given: no_buffer, the state strategy VAMP
    prices, since `auto` becomes the refused extra_buffer under the overlap scheduler (a GPU's default);
    SGLang allows no_buffer only without the overlap scheduler."""
    return ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]
