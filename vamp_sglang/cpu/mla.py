"""MLA attention (DeepSeek-V2/V3, Kimi-K2) on SGLang 0.5.23's CPU path: torch_native takes the absorbed-MLA route.

`DeepseekV2AttentionMLA.dispatch_attn_forward_method` (models/deepseek_v2.py:2291) asks
`AttentionBackendRegistry.get_handler(backend)` (models/deepseek_common/attention_backend_handler.py:53)
which forward method a batch takes. torch_native has no entry there, so it gets the triton handler
(`:54`), which sends a prefill without a cached prefix to the MHA method (`:234`): that one writes the
latent and reads back per-head K/V as if the pool held them, and torch_native, which reads its K/V
from the latent pool, fails on the first prefill (`Expected size ... [4, 48] but got: [4, 80]`,
layers/attention/torch_native_backend.py:160). Answering "torch_native" with SGLang's own absorbed-MLA
dispatch (`_dispatch_mla_subtype`, `:59`) runs every batch through the MLA method, whose queries are
absorbed into the latent space, and torch_native's SDPA over `[latent | rope]` rows then matches
transformers' output. Other backends keep their handlers; a GPU server never gets this hook.
"""

from __future__ import annotations

from typing import Any

from vamp_sglang.integration.hooks import Hook

TORCH_NATIVE = "torch_native"


def torch_native_mla(attn: Any, forward_batch: Any) -> Any:
    """The handler torch_native lacks: always SGLang's absorbed-MLA forward method."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import _dispatch_mla_subtype

    return _dispatch_mla_subtype(attn, forward_batch)


def get_handler(original, registry: Any, backend_name: str) -> Any:
    """Around `AttentionBackendRegistry.get_handler`: torch_native's handler, the others unchanged."""
    if backend_name == TORCH_NATIVE:
        return torch_native_mla
    return original(registry, backend_name)


HOOKS = [
    Hook("sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.get_handler",
         "around", get_handler,
         "CPU mode: MLA models (DeepSeek) on torch_native take the absorbed-MLA forward (the triton fallback "
         "picks MHA, whose per-head K/V torch_native cannot read from the latent pool)"),
]
