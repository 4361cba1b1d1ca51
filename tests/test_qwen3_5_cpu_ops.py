"""Qwen3.5's four fused CPU ops in the stand-in `sgl_kernel` against the unfused math SGLang runs elsewhere.

The references are SGLang's own: `GemmaRMSNorm.forward_native` for the query/key norms, the query/gate
de-interleave of `Qwen3_5AttentionDecoderLayer.forward_prepare_native`, `Qwen3_5GatedDeltaNet.
fix_query_key_value_ordering` plus its `torch.cat` for the Gated DeltaNet split (the path SGLang takes when the
fused split does not apply), and attn * sigmoid(gate) as the Triton kernel's docstring states it. The ops are
called through `torch.ops.sgl_kernel`, as SGLang calls them, and a fresh CPU-mode interpreter checks that
models/qwen3_5.py imports with them bound.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vamp_sglang.cpu import SHIM_DIR, cpu_environment

T, HQ, HK, D, EPS = 5, 4, 2, 16, 1e-6  # tokens, query heads, KV heads, head dim
LK, LV, DK, DV = 2, 4, 8, 6  # Gated DeltaNet key heads, value heads, key and value head dims


@pytest.fixture(scope="module")
def ops():
    spec = importlib.util.spec_from_file_location("vamp_test_qwen3_5_ops", SHIM_DIR / "sgl_kernel" / "qwen3_5.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return torch.ops.sgl_kernel


def _gemma(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    norm = GemmaRMSNorm(x.shape[-1], eps=EPS)
    norm.weight.data.copy_(weight)
    return norm.forward_native(x)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_gemma_rmsnorm_equals_sglangs_gemma_rmsnorm_per_head(ops, dtype):
    qkv = _randn(T, (HQ + 2 * HK) * D, dtype=dtype)
    q, k, _ = qkv.split([HQ * D, HK * D, HK * D], dim=-1)  # strided views, as SGLang passes them
    q_weight, k_weight = _randn(D, seed=1) * 0.1, _randn(D, seed=2) * 0.1
    q_out, k_out = ops.fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, EPS, D)
    assert q_out.shape == (T * HQ, D) and k_out.shape == (T * HK, D) and q_out.dtype == dtype
    torch.testing.assert_close(q_out, _gemma(q.reshape(-1, D), q_weight), rtol=0, atol=0)
    torch.testing.assert_close(k_out, _gemma(k.reshape(-1, D), k_weight), rtol=0, atol=0)


def test_qk_gemma_rmsnorm_with_gate_deinterleaves_as_the_native_path(ops):
    qkv = _randn(T, (2 * HQ + 2 * HK) * D)
    q_gate, k, _ = qkv.split([2 * HQ * D, HK * D, HK * D], dim=-1)
    q_weight, k_weight = _randn(D, seed=3) * 0.1, _randn(D, seed=4) * 0.1
    q_out, k_out, gate_out = ops.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, EPS, D, HQ)
    q, gate = torch.chunk(q_gate.view(T, HQ, -1), 2, dim=-1)  # forward_prepare_native
    torch.testing.assert_close(q_out, _gemma(q.reshape(-1, D), q_weight), rtol=0, atol=0)
    torch.testing.assert_close(k_out, _gemma(k.reshape(-1, D), k_weight), rtol=0, atol=0)
    assert torch.equal(gate_out, gate.reshape(-1, D)) and gate_out.is_contiguous()


@pytest.mark.parametrize("gate_shape", ["strided", "flat"])
def test_sigmoid_mul_gates_in_place(ops, gate_shape):
    attn = _randn(T, HQ * D, seed=5)
    strided = _randn(T, HQ, 2 * D, seed=6)[..., D:]  # the gate halves of the query/gate projection
    expected = attn * torch.sigmoid(strided.reshape(T, -1))
    gate = strided if gate_shape == "strided" else strided.reshape(T, -1)
    out = attn.clone()
    assert ops.fused_sigmoid_mul_cpu(out, gate) is None
    torch.testing.assert_close(out, expected)  # float32 tolerance: sigmoid's vector and scalar paths differ
    assert not torch.equal(out, attn)


@pytest.mark.parametrize("tokens", [1, T])  # one token: every slice is already contiguous, yet copied
def test_qkvzba_split_equals_sglangs_unfused_split(ops, tokens):
    from sglang.srt.models.qwen3_5 import Qwen3_5GatedDeltaNet

    qkvz = _randn(tokens, 2 * LK * DK + 2 * LV * DV, seed=7)
    ba = _randn(tokens, 2 * LV, seed=8)
    layer = SimpleNamespace(key_dim=LK * DK, value_dim=LV * DV, num_v_heads=LV, attn_tp_size=1, head_v_dim=DV)
    query, key, value, z, b, a = Qwen3_5GatedDeltaNet.fix_query_key_value_ordering(layer, qkvz, ba)
    mixed = torch.cat([x.reshape(tokens, -1) for x in (query, key, value)], dim=-1)
    got = ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, LK, LV, DK, DV)
    for out, ref in zip(got, (mixed, z, b, a), strict=True):
        assert out.shape == ref.shape and torch.equal(out, ref) and out.is_contiguous()
        assert out.data_ptr() not in (qkvz.data_ptr(), ba.data_ptr())


def test_qkvzba_split_refuses_widths_that_do_not_match_the_heads(ops):
    with pytest.raises(ValueError, match="4 value heads of 6"):
        ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(_randn(T, 10), _randn(T, 2 * LV), LK, LV, DK, DV)


QWEN3_5_IMPORT_PROBE = """
import json
import torch
import sglang.srt.models.qwen3_5 as m
from sglang.srt.utils import is_cpu
names = ("_fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm", "fused_qk_gemma_rmsnorm_with_gate",
         "fused_qkvzba_split_reshape_cat_contiguous")
print(json.dumps({"is_cpu": is_cpu(), "amx": hasattr(torch.ops.sgl_kernel, "convert_weight_packed"),
                  "bound": [getattr(getattr(m, name), "_qualified_op_name", None) for name in names]}))
"""


def test_sglang_qwen3_5_imports_in_cpu_mode_with_the_four_ops_bound():
    proc = subprocess.run([sys.executable, "-c", QWEN3_5_IMPORT_PROBE], env={**os.environ, **cpu_environment()},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe == {"is_cpu": True, "amx": False, "bound": [
        "sgl_kernel::fused_sigmoid_mul_cpu", "sgl_kernel::fused_qk_gemma_rmsnorm_cpu",
        "sgl_kernel::fused_qk_gemma_rmsnorm_with_gate_cpu", "sgl_kernel::fused_qkvzba_split_reshape_cat_contiguous_cpu"]}
