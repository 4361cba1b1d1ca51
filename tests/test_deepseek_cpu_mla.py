"""CPU mode's MLA hook: torch_native gets SGLang's absorbed-MLA dispatch, every other backend its own handler.

Without it `AttentionBackendRegistry.get_handler("torch_native")` falls back to the triton handler, which
sends a prefill without a cached prefix to the MHA method (models/deepseek_common/attention_backend_handler.py),
which torch_native cannot serve from the latent pool. The server test (test_deepseek_server.py) checks the
tokens; this checks the dispatch on SGLang's real registry and forward modes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vamp_sglang.cpu import mla


@pytest.fixture(scope="module")
def handler_module():
    from sglang.srt.models.deepseek_common import attention_backend_handler

    return attention_backend_handler


def _original(module):
    return module.AttentionBackendRegistry.__dict__["get_handler"].__func__


def _prefill_without_prefix():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_prefix_lens_cpu=[0])


def test_the_stock_registry_sends_torch_native_to_the_triton_handler(handler_module):
    registry = handler_module.AttentionBackendRegistry
    assert _original(handler_module)(registry, "torch_native") is handler_module.handle_attention_triton


def test_torch_native_takes_the_absorbed_mla_method_even_for_a_fresh_prefill(handler_module):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    registry, attn, batch = handler_module.AttentionBackendRegistry, SimpleNamespace(), _prefill_without_prefix()
    handler = mla.get_handler(_original(handler_module), registry, "torch_native")
    assert handler is not handler_module.handle_attention_triton
    assert handler(attn, batch) is AttnForwardMethod.MLA


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3", "intel_amx"])
def test_other_backends_keep_their_handlers(handler_module, backend):
    registry = handler_module.AttentionBackendRegistry
    assert mla.get_handler(_original(handler_module), registry, backend) is registry.get_handler(backend)


def test_the_hook_is_placed_in_cpu_mode_only(monkeypatch):
    from vamp_sglang.integration import plugin

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert set(mla.HOOKS) <= set(plugin.cpu_hooks())
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    assert plugin.cpu_hooks() == []
