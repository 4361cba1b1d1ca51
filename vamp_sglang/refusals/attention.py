"""Attention kernels that keep the KV pool's start-up size in a captured decode graph, refused with VAMP on.

VAMP grows the KV pool at fixed addresses while decode graphs stay captured (integration/gpu_flags.py), so a
kernel stays correct only if it reads the pool through pointers and strides alone. A kernel that bakes the
pool's extent at capture reads tokens in grown rows wrong after an offload, silently. In SGLang 0.5.23 (paths
under sglang/srt; the review behind this is research/gpu-review-3.md, defects 1, 2 and 7):
- an MLA model with an FP8 KV cache: the absorbed decode of `fa3` and `flashinfer` converts the layer's
  whole latent pool to bf16 on every call (layers/attention/flashattention_backend.py:2350,
  flashinfer_mla_backend.py:822; `prepare_paged_mha_query` casts q to the cache dtype only when
  head_dim <= 256, :1426-1438, and MLA's is 576). Captured, that copy converts only the start-up rows.
  `triton` reads the FP8 latents in place (triton_backend.py:2474, in forward_decode). fa3 is the Hopper MLA
  default and flashinfer the Blackwell one (arg_groups/model_override_base.py:333-336), and SGLang moves only
  fp8_e5m2 off fa3 (arg_groups/overrides.py:1263-1271), so FP8 is refused unless every backend a decode graph
  runs is `triton`. An FP8 cache comes from `--kv-cache-dtype fp8_e4m3`/`fp8_e5m2`, or from `auto` on a
  checkpoint whose quantisation config says FP8 KV (mem_cache/kv_cache_dtype.py:49-57).
- `flashmla`, `trtllm_mla`, `cutedsl_mla` (`tokenspeed_mla` is its old name): FlashMLA's K TMA descriptor is
  built from the paged view's page count (flashmla_backend.py:478-480, mem_cache/layout/paged_view.py:11-25)
  and passed by value at launch, so a captured replay reads grown pages as zeros; the other two also build
  TMA descriptors from the cache shape and stay refused until a GPU check shows them safe.
- `fa3` paged KV: FA3 switches to TMA (page count baked) when page_size % kBlockN == 0 and
  seqlen_q * (heads / kv_heads) > kBlockM (FA3 `get_pagedkv_tma`). kBlockM and kBlockN are at least 64 in
  FA3's SM90 tile table, so a page below 64, or at most 64 query rows per KV head on a rank, is shown safe;
  anything else with fa3 possible (named, or SGLang's Hopper default) is refused, as is a model whose heads
  the launcher cannot read.
A decode graph captures the decode backend and, with NGRAM speculative decoding, the target-verify one: the
prefill backend unless `--speculative-attention-mode decode` (layers/attention/hybrid_attn_backend.py:79-88).
On CPU no graph captures attention (torch_native turns CUDA graphs off, arg_groups/attention_hook.py:124-141,
and converts only the rows it gathered per request, torch_native_backend.py:238-247), so CPU is not refused.
A DeepSeek-V3-family model on Blackwell with no attention flag gets trtllm_mla from SGLang itself
(arg_groups/model_overrides/deepseek_v2.py:178-187) and the launcher does not know the GPU: that case is
refused at scheduler start, when the MLA pool is laid out (integration/kv_pool.check_pool, same message).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vamp_sglang.local_config import local_model_config

BACKEND_FLAGS = ("--attention-backend", "--decode-attention-backend", "--prefill-attention-backend")
TMA_MLA_BACKENDS = ("flashmla", "trtllm_mla", "cutedsl_mla", "tokenspeed_mla")
FP8_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2")
FA3_SMALLEST_TILE = 64  # FA3's SM90 kBlockM and kBlockN are never below it
NGRAM_DRAFT_TOKENS = 12  # SGLang's default (arg_groups/speculative_hook.py:1314-1319)
_SUFFIX = "is not supported with --vamp-max-offload-ratio > 0"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The SGLang flags `refused` reads, besides --page-size, --kv-cache-dtype and --speculative-algorithm,
    which the HiCache, MLA and hybrid modules add."""
    for flag in BACKEND_FLAGS:
        parser.add_argument(flag, default=None)
    parser.add_argument("--speculative-attention-mode", default="prefill")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    for flag, alias in (("--attn-dp-size", "--attention-data-parallel-size"),
                        ("--attn-cp-size", "--attention-context-parallel-size"),
                        ("--dp-size", "--data-parallel-size")):
        parser.add_argument(flag, alias, dest=flag[2:].replace("-", "_"), type=int, default=1)
    parser.add_argument("--dcp-size", type=int, default=1)


def _text_config(model_path: str | None) -> dict[str, Any]:
    config = local_model_config(model_path)
    return config.get("text_config") or config


def is_mla(model_path: str | None) -> bool | None:
    """Whether SGLang serves the model with MLA (every MLA architecture reads `kv_lora_rank`,
    configs/model_config.py:1397-1512); None when there is no local config.json."""
    text = _text_config(model_path)
    if not text:
        return None
    return text.get("kv_lora_rank") is not None and text.get("use_mla", True) is not False


def checkpoint_kv_is_fp8(model_path: str | None) -> bool:
    """Whether `--kv-cache-dtype auto` becomes FP8 for this checkpoint: `kv_cache_quant_algo` FP8 or an 8-bit
    float `kv_cache_scheme` in config.json's quantization_config, or in ModelOpt's hf_quant_config.json
    (layers/quantization/fp8.py:366, modelopt_quant.py:480-499)."""
    quant = local_model_config(model_path).get("quantization_config") or {}
    extra = Path(model_path) / "hf_quant_config.json" if model_path else None
    if extra is not None and extra.is_file():
        quant = {**quant, **(json.loads(extra.read_text()).get("quantization") or {})}
    scheme = quant.get("kv_cache_scheme") or {}
    return (str(quant.get("kv_cache_quant_algo")).upper() == "FP8"
            or (isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8))


def _ngram(sg: argparse.Namespace) -> bool:
    return (sg.speculative_algorithm or "").upper() == "NGRAM"


def _named(sg: argparse.Namespace, phase: str) -> tuple[str, str | None]:
    """The flag that picks `phase`'s backend, and its value (None: SGLang's choice)."""
    split = getattr(sg, f"{phase}_attention_backend")
    return (f"--{phase}-attention-backend", split) if split else ("--attention-backend", sg.attention_backend)


def captured_backends(sg: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(flag, backend) of each attention backend a decode graph captures (backend None: SGLang's choice)."""
    chosen = [_named(sg, "decode")]
    if _ngram(sg) and sg.speculative_attention_mode != "decode":
        chosen.append(_named(sg, "prefill"))
    return chosen


def _shown(flag: str, backend: str | None) -> str:
    return f"{flag} {backend}" if backend else f"no {flag} (SGLang's default is fa3 on Hopper)"


def _query_rows_per_kv_head(sg: argparse.Namespace, mla: bool) -> int | None:
    """FA3's `seqlen_q * (heads / kv_heads)` on one rank, at most; None when config.json lacks the heads."""
    text = _text_config(sg.model_path)
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    attn_dp = sg.attn_dp_size if sg.attn_dp_size > 1 else (sg.dp_size if sg.enable_dp_attention else 1)
    attn_tp = max(1, sg.tp_size // max(1, attn_dp * sg.attn_cp_size))
    q_heads = -(-heads * sg.dcp_size // attn_tp)
    kv_heads = 1 if mla else max(1, (text.get("num_key_value_heads") or heads) // attn_tp)
    seqlen_q = (sg.speculative_num_draft_tokens or NGRAM_DRAFT_TOKENS) if _ngram(sg) else 1
    return seqlen_q * q_heads // kv_heads


def _fp8_mla_refusal(sg: argparse.Namespace, captured: list, mla: bool | None) -> str | None:
    fp8 = sg.kv_cache_dtype in FP8_KV_DTYPES or (sg.kv_cache_dtype in (None, "auto")
                                                 and checkpoint_kv_is_fp8(sg.model_path))
    if not fp8 or mla is False or all(backend == "triton" for _, backend in captured):
        return None
    shown = " and ".join(_shown(flag, backend) for flag, backend in captured if backend != "triton")
    model = "an MLA model" if mla else f"{sg.model_path} (no local config.json: it may be MLA)"
    return (f"--kv-cache-dtype {sg.kv_cache_dtype or 'auto'} (FP8 KV) with {shown} {_SUFFIX} on {model}: "
            f"the absorbed decode converts the whole latent pool to bf16 in a copy a CUDA graph keeps at its "
            f"start-up size; pass --attention-backend triton or a bf16 KV cache")


def _fa3_tma_refusal(sg: argparse.Namespace, captured: list, mla: bool | None) -> str | None:
    fa3 = [(flag, backend) for flag, backend in captured if backend in (None, "fa3")]
    page_size = sg.page_size or 1
    if not fa3 or page_size < FA3_SMALLEST_TILE:
        return None
    rows = None if mla is None else _query_rows_per_kv_head(sg, mla)
    if rows is not None and rows <= FA3_SMALLEST_TILE:
        return None
    return (f"--page-size {page_size} with {_shown(*fa3[0])} {_SUFFIX} at "
            f"{'an unknown number of' if rows is None else rows} query rows per KV head (over "
            f"{FA3_SMALLEST_TILE}, or the model's heads unknown): FA3 then reads paged KV through TMA with "
            f"the page count of graph capture; use --page-size below {FA3_SMALLEST_TILE} or "
            f"--attention-backend triton")


def tma_backend_refusal(backends: dict[str, str | None]) -> str | None:
    """The refusal of an MLA backend whose TMA descriptor bakes the page count, given {flag: backend}: the
    launcher passes the flags as given, kv_pool.check_pool the backends SGLang resolved (the case the
    launcher cannot see: SGLang picks trtllm_mla itself for DeepSeek-V3 on Blackwell)."""
    for flag, backend in backends.items():
        if backend in TMA_MLA_BACKENDS:
            return (f"{flag} {backend} {_SUFFIX} (its kernel's TMA descriptor keeps the KV page count of "
                    f"graph capture, so tokens in grown pages would read as zeros); use fa3, flashinfer or "
                    f"triton")
    return None


def refused(sg: argparse.Namespace) -> str | None:
    """The refusal, naming the flags, of an attention backend that bakes the pool's extent; or None."""
    named = {flag: getattr(sg, flag.removeprefix("--").replace("-", "_")) for flag in BACKEND_FLAGS}
    if refusal := tma_backend_refusal(named):
        return refusal
    if (sg.device or "cuda") == "cpu":
        return None
    captured, mla = captured_backends(sg), is_mla(sg.model_path)
    return _fp8_mla_refusal(sg, captured, mla) or _fa3_tma_refusal(sg, captured, mla)
