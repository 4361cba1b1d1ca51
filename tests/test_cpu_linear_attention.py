"""The plain-torch Gated DeltaNet ops of the CPU stand-in against naive references.

The references below are written independently of vamp_sglang.cpu.linear_attention: FLA's naive
recurrent gated delta rule (explicit loops over requests, heads and tokens, state `[K, V]`) and a
causal conv written as a sum over taps. Prefill in one go, prefill in chunks resumed from the slot,
and token-by-token decode must all agree, for several requests in one batch.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vamp_sglang.cpu import SHIM_DIR
from vamp_sglang.cpu import linear_attention as ops

H, HV, K, V, D, W = 2, 4, 8, 6, 20, 4  # k-heads, v-heads, dims; conv channels and kernel
ATOL = 1e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def naive_gated_delta(q, k, v, g, beta, state):
    """FLA-style naive recurrence for one request: q, k [T, H, K]; v [T, HV, V]; state [HV, K, V]."""
    out = torch.zeros(v.shape)
    state = state.clone()
    for hv in range(v.shape[1]):
        h = hv // (v.shape[1] // q.shape[1])
        for t in range(v.shape[0]):
            qt = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + 1e-6) * K ** -0.5
            kt = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + 1e-6)
            state[hv] = state[hv] * torch.exp(g[t, hv])
            u = beta[t, hv] * (v[t, hv] - state[hv].T @ kt)
            state[hv] = state[hv] + torch.outer(kt, u)
            out[t, hv] = state[hv].T @ qt
    return out, state


def _inputs(tokens, seed=0):
    gen = _gen(seed)
    q = torch.randn(1, tokens, H, K, generator=gen)
    k = torch.randn(1, tokens, H, K, generator=gen)
    v = torch.randn(1, tokens, HV, V, generator=gen)
    a = torch.randn(tokens, HV, generator=gen)
    b = torch.randn(tokens, HV, generator=gen)
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen) * 0.5
    return q, k, v, a, b, A_log, dt_bias


def _pool(slots, seed=1):
    return torch.randn(slots, HV, V, K, generator=_gen(seed))  # V-major, K contiguous


def test_gating_matches_the_formula_and_softplus_threshold():
    _, _, _, a, b, A_log, dt_bias = _inputs(5)
    a[0, 0] = 30.0  # past the threshold: softplus(x) = x
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    assert g.shape == beta.shape == (1, 5, HV) and g.dtype == beta.dtype == torch.float32
    x = a + dt_bias
    expected = -A_log.exp() * torch.where(x <= 20, torch.log1p(x.exp()), x)
    torch.testing.assert_close(g[0], expected)
    torch.testing.assert_close(beta[0], torch.sigmoid(b))


def test_prefill_matches_naive_reference_from_the_slot_state_and_writes_it_back():
    q, k, v, a, b, A_log, dt_bias = _inputs(9)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    pool = _pool(4)
    start = pool[2].clone()
    out, final, h = ops.chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool,
                                               cu_seqlens=torch.tensor([0, 9], dtype=torch.int32),
                                               initial_state_indices=torch.tensor([2], dtype=torch.int32))
    assert final is None and h is None and out.shape == (1, 9, HV, V)
    ref_out, ref_state = naive_gated_delta(q[0], k[0], v[0], g[0], beta[0], start.transpose(-1, -2))
    torch.testing.assert_close(out[0], ref_out, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(pool[2], ref_state.transpose(-1, -2), atol=ATOL, rtol=1e-4)
    assert torch.equal(pool[[0, 1, 3]], _pool(4)[[0, 1, 3]])  # other slots untouched


def test_chunked_prefill_and_token_by_token_decode_agree_with_one_prefill():
    q, k, v, a, b, A_log, dt_bias = _inputs(10, seed=3)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    one, chunked, decoded = (torch.zeros(2, HV, V, K) for _ in range(3))
    slot = torch.tensor([1], dtype=torch.int32)
    whole, _, _ = ops.chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=one,
                                             cu_seqlens=torch.tensor([0, 10]), initial_state_indices=slot)
    parts = []
    for lo, hi in [(0, 4), (4, 10)]:
        out, _, _ = ops.chunk_gated_delta_rule(q=q[:, lo:hi], k=k[:, lo:hi], v=v[:, lo:hi], g=g[:, lo:hi],
                                               beta=beta[:, lo:hi], initial_state=chunked,
                                               cu_seqlens=torch.tensor([0, hi - lo]), initial_state_indices=slot)
        parts.append(out)
    steps = [ops.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[t:t + 1], b[t:t + 1], decoded, slot,
        torch.tensor([0, 1]), True) for t in range(10)]
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(chunked, one, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(decoded, one, atol=ATOL, rtol=1e-4)
    assert one[1].abs().sum() > 0 and torch.equal(one[0], torch.zeros(HV, V, K))


def test_varlen_batch_matches_each_request_alone_and_skips_pad_slots():
    lengths, slots = [3, 1, 5, 2], [3, -1, 0, 2]
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), seed=5)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    pool = _pool(5, seed=7)
    expected = _pool(5, seed=7)
    cu = torch.tensor([0, 3, 4, 9, 11], dtype=torch.int32)
    out, _, _ = ops.chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu,
                                           initial_state_indices=torch.tensor(slots, dtype=torch.int32))
    for seq, slot in enumerate(slots):
        lo, hi = cu[seq].item(), cu[seq + 1].item()
        start = expected[slot].transpose(-1, -2) if slot >= 0 else torch.zeros(HV, K, V)
        ref_out, ref_state = naive_gated_delta(q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi],
                                               beta[0, lo:hi], start)
        torch.testing.assert_close(out[0, lo:hi], ref_out, atol=ATOL, rtol=1e-4)
        if slot >= 0:
            expected[slot] = ref_state.transpose(-1, -2)
    torch.testing.assert_close(pool, expected, atol=ATOL, rtol=1e-4)  # slots 1 and 4 untouched


def test_decode_batch_matches_naive_reference_per_request():
    slots = torch.tensor([4, 1, -1], dtype=torch.int32)
    q, k, v, a, b, A_log, dt_bias = _inputs(3, seed=9)
    pool = _pool(5, seed=11)
    before = pool.clone()
    out = ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pool, slots,
                                                     torch.arange(4, dtype=torch.int32), True)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    for row, slot in enumerate(slots.tolist()):
        start = before[slot].transpose(-1, -2) if slot >= 0 else torch.zeros(HV, K, V)
        ref_out, ref_state = naive_gated_delta(q[0, row:row + 1], k[0, row:row + 1], v[0, row:row + 1],
                                               g[0, row:row + 1], beta[0, row:row + 1], start)
        torch.testing.assert_close(out[0, row:row + 1], ref_out, atol=ATOL, rtol=1e-4)
        if slot >= 0:
            torch.testing.assert_close(pool[slot], ref_state.transpose(-1, -2), atol=ATOL, rtol=1e-4)
    assert torch.equal(pool[[0, 2, 3]], before[[0, 2, 3]])


def naive_causal_conv(x, weight, prev):
    """x [D, T], prev [D, W-1] -> silu(sum over taps), taps read (prev, x) causally."""
    full = torch.cat([prev, x], -1)
    out = torch.zeros_like(x)
    for t in range(x.shape[1]):
        out[:, t] = (full[:, t:t + W] * weight).sum(-1)
    return F.silu(out), full[:, -(W - 1):]


def test_conv_prefill_varlen_with_initial_states_matches_naive_and_decode():
    gen = _gen(13)
    weight = torch.randn(D, W, generator=gen)
    x = torch.randn(D, 9, generator=gen)
    states = torch.randn(4, D, W - 1, generator=gen)
    before = states.clone()
    cu = torch.tensor([0, 2, 7, 9], dtype=torch.int32)
    slots, initial = [2, 0, 3], [True, False, True]
    out = ops.causal_conv1d_fn(x, weight, None, activation="silu", conv_states=states,
                               has_initial_state=torch.tensor(initial), cache_indices=torch.tensor(slots),
                               query_start_loc=cu, seq_lens_cpu=[2, 5, 2])
    decoded = before.clone()
    for seq, slot in enumerate(slots):
        lo, hi = cu[seq].item(), cu[seq + 1].item()
        prev = before[slot] if initial[seq] else torch.zeros(D, W - 1)
        ref, ref_state = naive_causal_conv(x[:, lo:hi], weight, prev)
        torch.testing.assert_close(out[:, lo:hi], ref, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(states[slot], ref_state)
        decoded[slot] = prev
        steps = [ops.causal_conv1d_update(x[None, :, t], decoded, weight, None, "silu",
                                          conv_state_indices=torch.tensor([slot])) for t in range(lo, hi)]
        torch.testing.assert_close(torch.cat(steps).T, ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(decoded, states)
    assert torch.equal(states[1], before[1])


def test_conv_update_skips_pad_slots_and_refuses_tree_and_circular_arguments():
    weight = torch.randn(D, W, generator=_gen(17))
    states = torch.randn(3, D, W - 1, generator=_gen(19))
    before = states.clone()
    out = ops.causal_conv1d_update(torch.randn(2, D), states, weight, None, "silu",
                                   conv_state_indices=torch.tensor([-1, 2]))
    assert torch.equal(out[0], torch.zeros(D)) and torch.equal(states[:2], before[:2])
    assert not torch.equal(states[2], before[2])
    with pytest.raises(NotImplementedError, match="retrieve_next_token"):  # tree drafts
        ops.causal_conv1d_update(torch.randn(1, D), states, weight, retrieve_next_token=states)
    with pytest.raises(NotImplementedError, match="cache_seqlens"):
        ops.causal_conv1d_update(torch.randn(1, D), states, weight, cache_seqlens=torch.tensor([0]))
    with pytest.raises(ValueError, match="intermediate_state_indices"):
        ops.causal_conv1d_update(torch.randn(1, D), states, weight, intermediate_conv_window=states)


def test_shim_registers_the_two_torch_ops_with_sglangs_keywords_and_keeps_amx_off():
    """In a fresh interpreter with the shim first on sys.path, as a CPU server has it."""
    code = f"""
import sys; sys.path.insert(0, {str(SHIM_DIR)!r})
import torch
import sgl_kernel.mamba as m
q = torch.randn(1, 2, {H}, {K}); v = torch.randn(1, 2, {HV}, {V}); ab = torch.randn(2, {HV})
pool = torch.zeros(3, {HV}, {V}, {K})
out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
    A_log=torch.zeros({HV}), dt_bias=torch.zeros({HV}), q=q, k=q, v=v, a=ab, b=ab, initial_state_source=pool,
    initial_state_indices=torch.tensor([1, 2], dtype=torch.int32), cu_seqlens=torch.arange(3, dtype=torch.int32),
    use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0)
g, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(torch.zeros({HV}), ab, ab, torch.zeros({HV}))
assert out.shape == (1, 2, {HV}, {V}) and g.shape == (1, 2, {HV}) and pool[1:].abs().sum() > 0
assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
from sglang.srt.utils.common import cpu_has_amx_support
assert not cpu_has_amx_support()
assert m.causal_conv1d_fn_cpu and m.causal_conv1d_update_cpu and m.chunk_gated_delta_rule_cpu
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_shim_module_loads_under_another_name_too():
    """Loading the file twice in one process (tests) must not re-register the ops."""
    for name in ("vamp_test_mamba_a", "vamp_test_mamba_b"):
        spec = importlib.util.spec_from_file_location(name, SHIM_DIR / "sgl_kernel" / "mamba.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert hasattr(torch.ops.sgl_kernel, "fused_gdn_gating_cpu")
