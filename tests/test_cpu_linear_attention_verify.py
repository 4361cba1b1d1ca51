"""CPU mode's speculative verify on Qwen3-Next's linear attention (NEXTN/EAGLE chains), no server.

The verify runs a request's L draft tokens through each linear-attention layer at once and keeps, per draft
token, the conv window and recurrent state after it (SGLang's per-draft-token `intermediate_conv_window` and
`intermediate_ssm`, one row per request of the batch); after the verify the accepted step's state goes back to
the request's slot (`scatter_after_verify`). Each is checked against token-by-token decoding, which is what
serving without speculation computes.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vamp_sglang.cpu import SHIM_DIR
from vamp_sglang.cpu import linear_attention as ops

H, HV, K, V, D, W, L = 2, 4, 8, 6, 20, 4, 4  # k/v heads, dims, conv channels and kernel, draft tokens
ATOL = 1e-5
SLOTS = [3, -1, 1]  # state slots of the batch's three requests (-1: a padded request)
ROWS = [0, 1, 2]  # their rows in the per-draft-token buffers (SGLang: the batch position)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_conv_verify_keeps_each_draft_tokens_window_and_matches_decoding():
    gen = _gen(1)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    x = torch.randn(len(SLOTS), D, L, generator=gen)
    states = torch.randn(5, D, W - 1, generator=gen)
    before = states.clone()
    windows = torch.full((len(ROWS) + 1, L, D, W - 1), 7.0)
    out = ops.causal_conv1d_update(x, states, weight, bias, "silu", conv_state_indices=torch.tensor(SLOTS),
                                   intermediate_conv_window=windows, intermediate_state_indices=torch.tensor(ROWS))
    decoded = before.clone()
    for row, slot in enumerate(SLOTS):
        if slot < 0:
            assert torch.equal(out[row], torch.zeros(D, L)) and torch.equal(windows[row], torch.full((L, D, W - 1), 7.0))
            continue
        for t in range(L):
            step = ops.causal_conv1d_update(x[row:row + 1, :, t], decoded, weight, bias, "silu",
                                            conv_state_indices=torch.tensor([slot]))
            torch.testing.assert_close(out[row, :, t], step[0], atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(windows[row, t], decoded[slot])  # the window after draft token t
    torch.testing.assert_close(states, decoded)  # SGLang's kernel also leaves the last token's window in the slot
    assert torch.equal(states[[0, 2, 4]], before[[0, 2, 4]])


def _recurrent_inputs(seed):
    gen = _gen(seed)
    n = len(SLOTS) * L
    q, k = (torch.randn(1, n, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, n, HV, V, generator=gen)
    a, b = (torch.randn(n, HV, generator=gen) for _ in range(2))
    return q, k, v, a, b, torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen) * 0.5


def test_recurrent_verify_keeps_each_draft_tokens_state_and_leaves_the_pool():
    q, k, v, a, b, A_log, dt_bias = _recurrent_inputs(3)
    pool = torch.randn(5, HV, V, K, generator=_gen(5))
    before = pool.clone()
    buffer = torch.zeros(len(ROWS) + 1, L, HV, V, K)
    cu = torch.arange(0, len(SLOTS) * L + 1, L, dtype=torch.int32)
    out = ops.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q, k, v, a, b, pool, torch.tensor(SLOTS, dtype=torch.int32), cu, True,
        disable_state_update=True, intermediate_states_buffer=buffer,
        intermediate_state_indices=torch.tensor(ROWS, dtype=torch.int32))
    assert torch.equal(pool, before)
    decoded = before.clone()
    for row, slot in enumerate(SLOTS):
        # a padded request runs from a zero state, its states written all the same (as the Triton kernel's)
        states, index = (decoded, slot) if slot >= 0 else (torch.zeros(1, HV, V, K), 0)
        for t in range(L):
            i = row * L + t
            step = ops.fused_sigmoid_gating_delta_rule_update(
                A_log, dt_bias, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], a[i:i + 1], b[i:i + 1], states,
                torch.tensor([index], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), True)
            torch.testing.assert_close(out[:, i], step[:, 0], atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(buffer[row, t], states[index], atol=ATOL, rtol=1e-4)
    assert torch.equal(buffer[len(ROWS)], torch.zeros(L, HV, V, K))  # the padding row nobody names


def test_recurrent_verify_refuses_trees_and_half_given_buffers():
    q, k, v, a, b, A_log, dt_bias = _recurrent_inputs(7)
    args = (A_log, dt_bias, q, k, v, a, b, torch.zeros(5, HV, V, K), torch.tensor(SLOTS, dtype=torch.int32),
            torch.arange(0, len(SLOTS) * L + 1, L, dtype=torch.int32), True)
    with pytest.raises(NotImplementedError, match="tree"):
        ops.fused_sigmoid_gating_delta_rule_update(*args, retrieve_parent_token=torch.zeros(3, L))
    with pytest.raises(ValueError, match="together"):
        ops.fused_sigmoid_gating_delta_rule_update(*args, disable_state_update=True)


def test_scatter_after_verify_restores_the_accepted_step_into_slot_and_track_slot():
    from vamp_sglang.cpu.speculative import scatter_after_verify

    layers, slots = 2, 6
    temporal, conv = torch.zeros(layers, slots, HV, V, K), torch.zeros(layers, slots, D, W - 1)
    intermediate_ssm = torch.randn(layers, 4, L, HV, V, K, generator=_gen(9))
    windows = torch.randn(layers, 4, L, D, W - 1, generator=_gen(11))
    caches = SimpleNamespace(temporal=temporal, conv=[conv], intermediate_ssm=intermediate_ssm,
                             intermediate_conv_window=[windows])
    state_indices, steps = torch.tensor([3, 1, 5]), torch.tensor([2, 0, -1])  # request 2 accepted nothing
    scatter_after_verify(caches, state_indices, steps, torch.tensor([4, -1, 2]), torch.tensor([1, -1, -1]))
    torch.testing.assert_close(temporal[:, 3], intermediate_ssm[:, 0, 2])
    torch.testing.assert_close(temporal[:, 1], intermediate_ssm[:, 1, 0])
    torch.testing.assert_close(conv[:, 3], windows[:, 0, 2])
    torch.testing.assert_close(conv[:, 4], windows[:, 0, 1])  # the track slot of request 0's step 1
    assert temporal[:, [0, 2, 5]].abs().sum() == 0 and conv[:, [2, 5]].abs().sum() == 0


def test_shim_op_takes_sglangs_target_verify_keywords():
    """The torch op as SGLang's TritonGDNKernel.target_verify calls it on CPU (gdn_triton.py:217-255)."""
    code = f"""
import sys; sys.path.insert(0, {str(SHIM_DIR)!r})
import torch
import sgl_kernel.mamba
q = torch.randn(1, {2 * L}, {H}, {K}); v = torch.randn(1, {2 * L}, {HV}, {V}); ab = torch.randn({2 * L}, {HV})
pool = torch.randn(3, {HV}, {V}, {K}); before = pool.clone(); buf = torch.zeros(3, {L}, {HV}, {V}, {K})
torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
    A_log=torch.zeros({HV}), dt_bias=torch.zeros({HV}), q=q, k=q, v=v, a=ab, b=ab, initial_state_source=pool,
    initial_state_indices=torch.tensor([2, 1], dtype=torch.int32),
    cu_seqlens=torch.tensor([0, {L}, {2 * L}], dtype=torch.int32), use_qk_l2norm_in_kernel=True,
    softplus_beta=1.0, softplus_threshold=20.0, is_kda=False, disable_state_update=True,
    intermediate_states_buffer=buf, intermediate_state_indices=torch.tensor([0, 1], dtype=torch.int32),
    cache_steps={L}, retrieve_parent_token=None)
assert torch.equal(pool, before) and buf[:2].abs().sum() > 0 and buf[2].abs().sum() == 0
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
