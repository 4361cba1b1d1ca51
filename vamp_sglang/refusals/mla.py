"""MLA (DeepSeek) configurations VAMP cannot grow, refused by the launcher before anything loads.

VAMP grows SGLang's plain `MLATokenToKVPool` (one latent buffer per layer, integration/memory/kv_pool.py). SGLang
builds another pool, with buffers VAMP does not lay out, for:
- DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5: a DSA architecture whose config has `index_topk`,
  SGLang's `is_deepseek_dsa`, configs/model_config.py:191): `DSATokenToKVPool` adds per-layer indexer
  K caches with their own scales;
- a KV cache dtype with scale buffers (`--kv-cache-dtype nvfp4`, `fp4_mx_block16` or `mxfp8`): the FP4 and
  MXFP8 pools keep a scale tensor per layer next to the values.
MTP draft pools (`--speculative-algorithm` NEXTN, EAGLE) are plain MLA pools that grow with the target's
(integration/memory/draft_pools.py). Whatever slips past these (a pool SGLang picks by itself) is refused at scheduler start by
`kv_pool.check_pool`, which names the pool class. No SGLang import here: the launcher answers in a second.
"""

from __future__ import annotations

import argparse

from vamp_sglang.local_config import local_model_config

SCALED_KV_DTYPES = ("nvfp4", "fp4_mx_block16", "mxfp8")
# SGLang's is_deepseek_dsa architectures (configs/model_config.py:191-210), when the config has index_topk
DSA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLMNextN",
                     "MistralLarge3ForCausalLM", "PixtralForConditionalGeneration", "GlmMoeDsaForCausalLM",
                     "GlmMoeDsaForCausalLMNextN", "Glm5NextForConditionalGenerationNextN",
                     "Glm5NextForConditionalGeneration", "LongcatFlashForCausalLM", "LongcatFlashForCausalLMNextN",
                     "Dots3NoteForCausalLM", "Dots3NoteForCausalLMNextN", "HYV4ForCausalLM", "HYV4ForCausalLMNextN")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The SGLang flag `refused` reads, for the launcher's SGLang-free view of the argv."""
    parser.add_argument("--kv-cache-dtype", default=None)


def is_dsa(model_path: str | None) -> bool:
    """A local checkpoint SGLang serves with DSA's indexer cache (a hub name without config.json: False)."""
    config = local_model_config(model_path)
    text = config.get("text_config") or config  # a multimodal wrapper keeps the language model's fields
    return bool(set(config.get("architectures") or ()) & set(DSA_ARCHITECTURES)) and (
        text.get("index_topk") is not None)


def refused(sg: argparse.Namespace) -> str | None:
    """The refusal, naming the flag or the config field, for a KV pool VAMP cannot grow; or None."""
    if sg.kv_cache_dtype in SCALED_KV_DTYPES:
        return (f"--kv-cache-dtype {sg.kv_cache_dtype} is not supported with --vamp-max-offload-ratio > 0 (its KV "
                f"pool keeps per-layer scale buffers VAMP does not grow); use auto, bf16 or fp8_e4m3")
    if is_dsa(sg.model_path):
        return (f"{sg.model_path} uses DeepSeek Sparse Attention (config.json index_topk): its indexer KV cache "
                f"(DSATokenToKVPool) is not grown by VAMP; run with --vamp-max-offload-ratio 0")
    return None
