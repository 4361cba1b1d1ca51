"""Every MoE architecture SGLang 0.5.23 registers, served by VAMP or refused by name before anything loads.

A family is served when a tiny checkpoint of it (`python -m vamp_sglang.tiny_moe DIR --arch A`) and a
server test show its pools growing and its greedy outputs unchanged under VAMP. Every other MoE family is
refused at the launcher with VAMP on, reading config.json's `architectures`, with the family and what VAMP
lacks for it: a pool it does not grow, experts it does not page, or no test yet. A hub name has no local
config.json; it is decided at scheduler start as before (pools by class, experts by quant method).
tests/test_model_families.py derives the MoE architectures from SGLang's model registry and checks that
each is listed here once, and that README's model table is `markdown_table()`. No SGLang import here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vamp_sglang.local_config import local_model_config


def _archs(names: str) -> tuple[str, ...]:
    return tuple(names.split())


@dataclass(frozen=True)
class Family:
    """One model family: the `architectures` SGLang builds it from, and how VAMP treats it."""

    name: str
    archs: tuple[str, ...]
    tiny_archs: tuple[str, ...] = ()  # served: the tiny_moe --arch of its checkpoints and server tests
    pools: str = ""  # served: the pools VAMP grows
    reason: str = ""  # refused: what VAMP lacks for it

    @property
    def served(self) -> bool:
        return bool(self.tiny_archs)


_UNTESTED = ("no tiny checkpoint and server test check its pools and outputs under VAMP yet; it would take "
             "a tiny_moe family and a server test")
_MULTIMODAL = "a vision-language wrapper; " + _UNTESTED
_DENSE = "its checkpoints are dense (the class builds experts only for an MoE config): no experts to page"
_DRAFT = ("a speculative-decoding draft (MTP, NextN, EAGLE or assistant head), served only as the draft of "
          "--speculative-algorithm beside its target (pass the target as --model-path)")
_SWA = ("sliding-window layers: SGLang keeps their KV in a second, window-sized pool (SWAKVPool; "
        "is_hybrid_swa_model, configs/model_config.py:2651) that VAMP does not grow")
_LINEAR = ("hybrid Mamba2 / KDA / lightning linear-attention layers (configs/hybrid_arch.py): VAMP grows "
           "SGLang's state pool only as checked on Gated DeltaNet; " + _UNTESTED)
_NOT_FUSED = ("its experts are not a FusedMoE layer (the model's own tensors through fused_moe(), or one "
              "module per expert), and VAMP pages FusedMoE weights only")
_DSA = ("DeepSeek Sparse Attention: its indexer KV cache (DSATokenToKVPool) is not grown by VAMP, and its "
        "hybrid linear-attention layers (Glm5Next) are untested")

FAMILIES: tuple[Family, ...] = (
    Family(
        "Qwen3-MoE",
        _archs("Qwen3MoeForCausalLM"),
        tiny_archs=("qwen3_moe",), pools="KV"),
    Family(
        "Mixtral",
        _archs("MixtralForCausalLM"),
        tiny_archs=("mixtral",), pools="KV"),
    Family(
        "Qwen3-Next (hybrid)",
        _archs("Qwen3NextForCausalLM"),
        tiny_archs=("qwen3_next",),
        pools="KV and linear-attention state ([docs/hybrid-models.md](docs/hybrid-models.md))"),
    Family(
        "DeepSeek-V2/V3/R1, Kimi-K2 (MLA)",
        _archs("DeepseekV2ForCausalLM DeepseekV3ForCausalLM"),
        tiny_archs=("deepseek_v2", "deepseek_v3"),
        pools="the latent KV, one buffer per layer ([docs/deepseek.md](docs/deepseek.md))"),
    Family(
        "GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air",
        _archs("Glm4MoeForCausalLM"),
        tiny_archs=("glm4_moe",), pools="KV"),
    Family(
        "Qwen3.5 / Qwen3.6 MoE (hybrid)",
        _archs("Qwen3_5MoeForCausalLM Qwen3_5MoeForConditionalGeneration"),
        tiny_archs=("qwen3_5_moe",),
        pools="KV and linear-attention state, as Qwen3-Next's ([docs/hybrid-models.md](docs/hybrid-models.md))"),
    Family(
        "gpt-oss",
        _archs("GptOssForCausalLM"),
        reason="its experts ship as MXFP4 (quant method mxfp4), which VAMP does not page (unquantised and "
               "block-FP8 only), and its alternate sliding-window layers with attention sinks sit in "
               "SGLang's SWAKVPool, which VAMP does not grow"),
    Family(
        "DeepSeek-V4",
        _archs("DeepseekV4ForCausalLM"),
        reason="its compressed-sparse attention keeps sliding-window, compressed (C4/C128) and indexer "
               "caches in DeepSeekV4TokenToKVPool (mem_cache/deepseek_v4_memory_pool.py:943), none of which "
               "VAMP grows, and its routed experts may ship as MXFP4, which VAMP does not page"),
    Family(
        "Kimi-K2.5",
        _archs("KimiK25ForConditionalGeneration"),
        reason="a MoonViT vision wrapper over DeepSeek-V3's MLA model whose published checkpoint ships INT4 "
               "routed experts (compressed-tensors), which VAMP does not page (unquantised and block-FP8 "
               "only)"),
    Family(
        "MiniMax-M2",
        _archs("MiniMaxM2ForCausalLM"),
        tiny_archs=("minimax_m2",), pools="KV"),
    Family(
        "DeepSeek-V3.2, GLM-5 (DSA)",
        _archs("DeepseekV32ForCausalLM GlmMoeDsaForCausalLM Glm5NextForConditionalGeneration"),
        reason=_DSA),
    Family(
        "speculative drafts",
        _archs("BailingMoeForCausalLMNextN DSparkMiniMaxDraftModel DeepseekV3ForCausalLMNextN "
               "DeepseekV4ForCausalLMDSpark DeepseekV4ForCausalLMNextN Ernie4_5_MoeForCausalLMMTP "
               "ExaoneMoEForCausalLMMTP Gemma4AssistantForCausalLM Gemma4UnifiedAssistantForCausalLM "
               "GigaChat35ForCausalLMNextN Glm4MoeForCausalLMNextN Glm4MoeLiteForCausalLMNextN "
               "Glm5NextForConditionalGenerationNextN GlmMoeDsaForCausalLMNextN HYV3ForCausalLMNextN "
               "HYV4ForCausalLMNextN InklingForConditionalGenerationMTP IQuestQ1MTP "
               "LongcatFlashForCausalLMNextN MiMoV2MTP MistralLarge3ForCausalLMEagle NemotronHForCausalLMMTP"
               " Qwen3MoeForCausalLMMTP Qwen3NextForCausalLMMTP Qwen3_5ForCausalLMMTP Qwen4ExpForCausalLMMTP"
               " Step3p5MTP"),
        reason=_DRAFT),
    Family(
        "sliding-window MoE (Gemma 4, MiMo-V2, Step-3.5/3.7, Llama 4 VL, Granite-MoE-SWA, IQuest-Q1, Laguna,"
        " Mellum, Beam, Inkling)",
        _archs("BeamForCausalLM DiffusionGemmaForBlockDiffusion EmbeddingGemma2Model Gemma4ForCausalLM "
               "Gemma4ForConditionalGeneration Gemma4UnifiedForConditionalGeneration "
               "GraniteMoeSWAForCausalLM InklingForConditionalGeneration IQuestQ1ForCausalLM "
               "LagunaForCausalLM Llama4ForConditionalGeneration MellumForCausalLM MiMoV2FlashForCausalLM "
               "MiMoV2ForCausalLM Step3p5ForCausalLM Step3p7ForConditionalGeneration"),
        reason=_SWA),
    Family(
        "hybrid linear-attention MoE (Nemotron-H, LFM2-MoE, Zaya, Granite-4 hybrid, Kimi-Linear, Ling-2.5, "
        "Intern-S2 preview)",
        _archs("BailingMoeV2_5ForCausalLM GraniteMoeHybridForCausalLM "
               "InternS2PreviewForConditionalGeneration KimiLinearForCausalLM Lfm2MoeForCausalLM "
               "NemotronHForCausalLM NemotronHPuzzleForCausalLM NemotronH_Nano_Omni_Reasoning_V3 "
               "NemotronH_Nano_VL_V2 NemotronH_Omni_Reasoning_V3 ZayaForCausalLM"),
        reason=_LINEAR),
    Family(
        "experts outside FusedMoE (DeepSeek-MoE, DeepSeek-OCR, AFM-MoE, quantised Mixtral)",
        _archs("AfmoeForCausalLM DeepseekForCausalLM DeepseekOCRForCausalLM QuantMixtralForCausalLM "
               "UnlimitedOCRForCausalLM"),
        reason=_NOT_FUSED),
    Family(
        "dense classes that share MoE code (Qwen3.5 dense, Hunyuan dense, ERNIE 4.5 dense)",
        _archs("Ernie4_5_ForCausalLM HunYuanDenseV1ForCausalLM Qwen3_5ForCausalLM "
               "Qwen3_5ForConditionalGeneration"),
        reason=_DENSE),
    Family(
        "vision-language MoE wrappers",
        _archs("BailingMM2NativeForConditionalGeneration BailingMMNativeForConditionalGeneration "
               "BailingMoeV3VLForConditionalGeneration Cohere2VisionForConditionalGeneration "
               "DeepseekVL2ForCausalLM DotsVLMForCausalLM Ernie4_5_VLMoeForConditionalGeneration "
               "Glm4vMoeForConditionalGeneration InternS1ForConditionalGeneration "
               "InternS1ProForConditionalGeneration InternS2MobiusForConditionalGeneration InternVLChatModel"
               " KimiK3ForConditionalGeneration KimiVLForConditionalGeneration MiniCPMV "
               "MiniCPMV4_6ForConditionalGeneration MiniCPMV4_7ForConditionalGeneration "
               "MiniMaxM3SparseForConditionalGeneration MuseSparkForConditionalGeneration "
               "PaddleOCRVLForConditionalGeneration PixtralForConditionalGeneration "
               "Qwen3OmniMoeForConditionalGeneration Qwen3VLMoeForConditionalGeneration "
               "Qwen4ExpForConditionalGeneration Step3VLForConditionalGeneration"),
        reason=_MULTIMODAL),
    Family(
        "SGLang's Transformers backend (--model-impl transformers)",
        _archs("TransformersMoEEmbeddingModel TransformersMoEForCausalLM "
               "TransformersMoEForSequenceClassification TransformersMultiModalMoEEmbeddingModel "
               "TransformersMultiModalMoEForCausalLM TransformersMultiModalMoEForSequenceClassification"),
        reason=_UNTESTED),
    Family(
        "other text MoE (Qwen2-MoE, OLMoE, Phi-MoE, Grok-1, DBRX, ERNIE 4.5, Hunyuan, Xverse, Ling, "
        "Cohere2-MoE, EXAONE-MoE, Sarvam, SDAR, LLaDA2, GigaChat3.5, LongCat-Flash, Mistral Large 3, Llama "
        "4, Granite-MoE, GLM-4.7-Flash, MiniMax-M3, Kimi-K3-Linear, Xllm)",
        _archs("BailingMoEForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM BailingMoeV3ForCausalLM "
               "Cohere2MoeForCausalLM DbrxForCausalLM Ernie4_5_MoeForCausalLM ExaoneMoEForCausalLM "
               "ExaoneMoeForCausalLM GigaChat35ForCausalLM Glm4MoeLiteForCausalLM GraniteMoeForCausalLM "
               "GraniteMoeSharedForCausalLM Grok1ForCausalLM Grok1ModelForCausalLM HYV3ForCausalLM "
               "HYV4ForCausalLM HunYuanMoEV1ForCausalLM K2HorizonForCausalLM KimiK3LinearForCausalLM "
               "LLaDA2MoeModelLM Llama4ForCausalLM LongcatFlashForCausalLM MiniMaxM3SparseForCausalLM "
               "MistralLarge3ForCausalLM OlmoeForCausalLM PhiMoEForCausalLM Qwen2MoeForCausalLM "
               "SDARMoeForCausalLM SarvamMLAForCausalLM SarvamMoEForCausalLM XllmForCausalLM "
               "XverseMoeForCausalLM"),
        reason=_UNTESTED),
)
BY_ARCH: dict[str, Family] = {arch: family for family in FAMILIES for arch in family.archs}


def message(arch: str) -> str | None:
    """The refusal for a registered MoE architecture VAMP does not serve; None for a served or unknown one."""
    family = BY_ARCH.get(arch)
    if family is None or family.served:
        return None
    return (f"{arch} ({family.name}) is not supported with --vamp-max-offload-ratio > 0: {family.reason}; "
            f"run with --vamp-max-offload-ratio 0")


def refused(sg: argparse.Namespace) -> str | None:
    """The refusal for a local checkpoint whose config.json names a family VAMP does not serve, or None
    (a hub name without config.json is decided at scheduler start)."""
    for arch in local_model_config(sg.model_path).get("architectures") or ():
        if refusal := message(arch):
            return refusal
    return None


def markdown_table() -> str:
    """README's model table: every family with its architectures and status (served or refused: why)."""
    rows = ["| family | SGLang architectures (config.json) | with VAMP on |", "|---|---|---|"]
    for family in FAMILIES:
        tiny = ", ".join(f"`{arch}`" for arch in family.tiny_archs)
        status = (f"served: tiny model `--arch` {tiny}; grows {family.pools}" if family.served
                  else f"refused: {family.reason}")
        rows.append(f"| {family.name} | {', '.join(f'`{a}`' for a in family.archs)} | {status} |")
    return "\n".join(rows) + "\n"
