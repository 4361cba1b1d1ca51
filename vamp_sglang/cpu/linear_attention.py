"""Gated DeltaNet ops (Qwen3-Next's linear attention) in plain torch, for SGLang's CPU path.

SGLang 0.5.23 serves Qwen3-Next on CPU only with sgl-kernel's CPU build (`sgl_kernel.mamba` and two
`torch.ops.sgl_kernel` ops), which PyPI does not ship; our stand-in `sgl_kernel` exposes these
instead. Each function keeps the call signature SGLang uses and the semantics of the Triton kernel
SGLang runs on GPU:

- `causal_conv1d_fn` / `causal_conv1d_update`: kernels/ops/mamba/causal_conv1d_triton.py (prefill
  over a varlen batch, decode one token per request); conv states `[slots, D, W-1]`, updated in place;
- `fused_gdn_gating`: kernels/ops/attention/linear/fused_gdn_gating.py;
- `fused_sigmoid_gating_delta_rule_update`: kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py
  (decode: gating, l2-normalised q/k, one delta-rule step per token);
- `chunk_gated_delta_rule`: the prefill kernel (kernels/ops/attention/fla/chunk.py). Computed here
  token by token, which is the same recurrence without the chunked reformulation: exact, slower.

The recurrent state pool is `[slots, HV, V, K]` (V-major, K contiguous, as the Triton kernels index
it); value head `hv` reads key head `hv // (HV // H)`. A slot index of -1 (`PAD_SLOT_ID`) is a padded
request: it reads a zero state and writes nothing back. All arithmetic is float32.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1  # SGLang's marker for a padded request (causal_conv1d_triton.PAD_SLOT_ID)
L2NORM_EPS = 1e-6  # the kernels' q/k normalisation: x / sqrt(sum(x^2) + eps)


def _activate(out: torch.Tensor, activation) -> torch.Tensor:
    if activation in ("silu", "swish", True):
        return F.silu(out)
    if activation in (None, False):
        return out
    raise ValueError(f"causal conv1d: unsupported activation {activation!r} (silu, swish or None)")


def _depthwise_conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation) -> torch.Tensor:
    """Valid causal conv of window `[D, W-1+L]` with weight `[D, W]` -> `[D, L]` fp32, activated."""
    b = None if bias is None else bias.float()
    conv = F.conv1d(window[None], weight.float()[:, None, :], b, groups=window.shape[0])[0]
    return _activate(conv, activation)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     conv_states: torch.Tensor | None = None, query_start_loc: torch.Tensor | None = None,
                     seq_lens_cpu=None, cache_indices: torch.Tensor | None = None,
                     has_initial_state: torch.Tensor | None = None, activation="silu",
                     pad_slot_id: int = PAD_SLOT_ID, block_table=None, **_unused) -> torch.Tensor:
    """Depthwise causal conv over each sequence of a varlen batch; x `[D, T]` -> `[D, T]`, states `[slots, D, W-1]`.

    Sequence i (tokens query_start_loc[i]:query_start_loc[i+1]) starts from conv_states[cache_indices[i]]
    when has_initial_state[i], else from zeros, and leaves the last W-1 inputs of (state, tokens) in
    that slot.
    """
    if block_table is not None:
        raise NotImplementedError("causal_conv1d_fn: a conv block table (page-major state) is not supported on CPU")
    width = weight.shape[-1]
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist() if cache_indices is not None else list(range(len(starts) - 1))
    initial = has_initial_state.tolist() if has_initial_state is not None else [False] * len(slots)
    out = torch.zeros_like(x)
    for seq, slot in enumerate(slots):
        if slot == pad_slot_id:
            continue
        lo, hi = starts[seq], starts[seq + 1]
        tokens = x[:, lo:hi].float()
        prev = conv_states[slot].float() if initial[seq] else tokens.new_zeros(tokens.shape[0], width - 1)
        window = torch.cat([prev, tokens], dim=-1)
        out[:, lo:hi] = _depthwise_conv(window, weight, bias, activation).to(out.dtype)
        conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation=None, cache_seqlens=None,
                         conv_state_indices: torch.Tensor | None = None, num_accept_tokens=None,
                         intermediate_conv_window=None, intermediate_state_indices=None,
                         retrieve_next_token=None, retrieve_next_sibling=None, retrieve_parent_token=None,
                         pad_slot_id: int = PAD_SLOT_ID, **_unused) -> torch.Tensor:
    """Decode step: x `[bs, D]` (or `[bs, D, L]`) -> same shape; each request's conv state shifts in place.

    A speculative verify (EAGLE/NEXTN chain, L draft tokens) also passes `intermediate_conv_window`
    `[rows, L, D, W-1]`: row intermediate_state_indices[b], step t gets the window after draft token t, from
    which SGLang restores the accepted step's state after the verify (the Triton kernel's SAVE_INTERMEDIATE).
    """
    unsupported = {"cache_seqlens": cache_seqlens, "num_accept_tokens": num_accept_tokens,
                   "retrieve_next_token": retrieve_next_token, "retrieve_next_sibling": retrieve_next_sibling,
                   "retrieve_parent_token": retrieve_parent_token}
    if given := [name for name, arg in unsupported.items() if arg is not None]:
        raise NotImplementedError(f"causal_conv1d_update: {', '.join(given)} (circular buffers, tree drafts) "
                                  f"not supported on CPU")
    if (intermediate_conv_window is None) != (intermediate_state_indices is None):
        raise ValueError("causal_conv1d_update: intermediate_conv_window needs intermediate_state_indices")
    squeeze = x.dim() == 2
    tokens_all = x[..., None] if squeeze else x
    width = weight.shape[-1]
    state_len = conv_state.shape[-1]
    slots = (conv_state_indices.tolist() if conv_state_indices is not None else list(range(x.shape[0])))
    rows = None if intermediate_state_indices is None else intermediate_state_indices.tolist()
    out = torch.zeros_like(tokens_all)
    for row, slot in enumerate(slots):
        if slot == pad_slot_id:
            continue
        window = torch.cat([conv_state[slot].float(), tokens_all[row].float()], dim=-1)
        out[row] = _depthwise_conv(window[:, state_len - (width - 1):], weight, bias, activation).to(out.dtype)
        conv_state[slot] = window[:, -state_len:].to(conv_state.dtype)
        if rows is not None and rows[row] >= 0:
            steps = window.unfold(-1, width - 1, 1)[:, state_len - width + 2:]  # [D, L, W-1]: after token t
            intermediate_conv_window[rows[row]] = steps.transpose(0, 1).to(intermediate_conv_window.dtype)
    return out[..., 0] if squeeze else out


def fused_gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                     beta: float = 1.0, threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); a, b `[T, HV]` -> each `[1, T, HV]` fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=beta, threshold=threshold)
    return g[None], torch.sigmoid(b.float())[None]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def delta_rule_recurrence(q, k, v, g, beta, state, scale: float, l2norm: bool,
                          trace: torch.Tensor | None = None) -> torch.Tensor:
    """Run the gated delta rule over N independent sequences of T tokens; updates `state` in place.

    q, k `[N, T, H, K]`; v `[N, T, HV, V]`; g, beta `[N, T, HV]`; state `[N, HV, K, V]` fp32.
    Per token: S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T (q * scale). Returns o `[N, T, HV, V]` fp32.
    `trace` `[N, T, HV, K, V]`, when given, receives the state after each token.
    """
    group = v.shape[2] // q.shape[2]
    q = q.float().repeat_interleave(group, dim=2)
    k = k.float().repeat_interleave(group, dim=2)
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    v, g, beta = v.float(), g.float(), beta.float()
    out = v.new_empty(v.shape)
    for t in range(v.shape[1]):
        state.mul_(g[:, t].exp()[..., None, None])
        k_t = k[:, t]
        delta = (v[:, t] - torch.einsum("nhkv,nhk->nhv", state, k_t)) * beta[:, t, :, None]
        state.add_(k_t[..., :, None] * delta[..., None, :])
        out[:, t] = torch.einsum("nhkv,nhk->nhv", state, q[:, t])
        if trace is not None:
            trace[:, t] = state
    return out


def _run_per_slot(q, k, v, g, beta, pool, slots, cu_seqlens, scale, l2norm, verify=None) -> torch.Tensor:
    """The recurrence for each request of a varlen batch (B == 1) from and back to its pool slot.

    `verify` (buffer `[rows, T, HV, V, K]`, row per request): a speculative verify, which leaves the pool
    as it was and writes each request's state after every draft token to its row instead."""
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    lengths = {hi - lo for lo, hi in itertools.pairwise(bounds)}
    heads_v, dim_v, dim_k = pool.shape[1:]
    if lengths == {1} and bounds[-1] == len(slots):  # decode: one token per request, batch them
        groups = [(list(range(len(slots))), 0, len(slots))]
    else:
        groups = [([seq], bounds[seq], bounds[seq + 1]) for seq in range(len(slots))]
    for seqs, lo, hi in groups:
        ids = torch.tensor([slots[s] for s in seqs], dtype=torch.long, device=pool.device)
        valid = ids >= 0
        state = torch.zeros(len(seqs), heads_v, dim_k, dim_v, dtype=torch.float32, device=pool.device)
        state[valid] = pool[ids[valid]].float().transpose(-1, -2)
        shape = (len(seqs), (hi - lo) // len(seqs))  # [requests, tokens each]
        q_, k_, v_, g_, beta_ = (x[0, lo:hi].reshape(*shape, *x.shape[2:]) for x in (q, k, v, g, beta))
        trace = None if verify is None else state.new_empty(shape[0], shape[1], *state.shape[1:])
        o = delta_rule_recurrence(q_, k_, v_, g_, beta_, state, scale, l2norm, trace)
        out[0, lo:hi] = o.reshape(hi - lo, *o.shape[2:]).to(out.dtype)
        if verify is None:
            pool[ids[valid]] = state[valid].transpose(-1, -2).to(pool.dtype)
            continue
        buffer, rows = verify
        for n, seq in enumerate(seqs):
            if rows[seq] >= 0:
                buffer[rows[seq]] = trace[n].transpose(-1, -2).to(buffer.dtype)
    return out


def chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state, cu_seqlens, initial_state_indices,
                           scale: float | None = None, head_first: bool = False,
                           use_qk_l2norm_in_kernel: bool = True, **_unused):
    """Prefill: q, k `[1, T, H, K]`, v `[1, T, HV, V]`, g, beta `[1, T, HV]`; initial_state is the layer's
    whole state pool, read at and written back to initial_state_indices. Returns (o, None, None):
    SGLang reads the state from the pool (only NPU uses a returned final state; h is tracking-only)."""
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule: head_first layout is not supported on CPU")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = _run_per_slot(q, k, v, g, beta, initial_state, initial_state_indices.tolist(), cu_seqlens, scale,
                      use_qk_l2norm_in_kernel)
    return o, None, None


def fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                           initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel: bool,
                                           softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
                                           scale: float | None = None, disable_state_update: bool = False,
                                           intermediate_states_buffer: torch.Tensor | None = None,
                                           intermediate_state_indices: torch.Tensor | None = None,
                                           retrieve_parent_token: torch.Tensor | None = None) -> torch.Tensor:
    """Decode: gating from a, b (as `fused_gdn_gating`), then the recurrence from and back to the pool.

    q, k `[1, N, H, K]`; v `[1, N, HV, V]`; a, b `[N, HV]`; cu_seqlens `[bs + 1]`. Returns `[1, N, HV, V]`.
    A speculative verify (SGLang's TritonGDNKernel.target_verify, gdn_triton.py:217-255) passes
    `disable_state_update` and `intermediate_states_buffer` `[rows, T, HV, V, K]`: the pool stays, and row
    intermediate_state_indices[b] step t gets request b's state after draft token t (chains only).
    """
    if retrieve_parent_token is not None:
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update: tree drafts are not supported on CPU")
    if disable_state_update != (intermediate_states_buffer is not None) or (
            (intermediate_states_buffer is None) != (intermediate_state_indices is None)):
        raise ValueError("fused_sigmoid_gating_delta_rule_update: a verify passes disable_state_update, "
                         "intermediate_states_buffer and intermediate_state_indices together")
    g, beta = fused_gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    verify = None if intermediate_states_buffer is None else (intermediate_states_buffer,
                                                              intermediate_state_indices.tolist())
    return _run_per_slot(q, k, v, g, beta, initial_state_source, initial_state_indices.tolist(), cu_seqlens,
                         scale, use_qk_l2norm_in_kernel, verify)
