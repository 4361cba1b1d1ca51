"""EAGLE / NEXTN speculative decoding on SGLang 0.5.23's CPU path (torch_native attention), chains of top-k 1.

A draft step of SGLang's EAGLE worker (speculative/eagle_worker_v2.py) is three kinds of forward, and
torch_native lacks the attention of two (shared research `deploy-modes.md` section 3.4):
- the draft's multi-step decode: `DraftBackendFactory` (speculative/draft_utils.py:84-160) builds one
  backend per draft step from a map with no torch_native entry. `create_backend` adds one: a container of
  `speculative_num_steps - 1` `TorchNativeDraftStep`s. Step i's query is draft token i, written at column
  seq_len + i of its request's req->token row (the slots `assign_draft_cache_locs_contiguous` hands out,
  kernels/ops/speculative/cache_locs.py:39-110), so it attends to the first seq_len + i + 1 columns: the
  lengths the Triton and Intel AMX multi-step backends build (cache_locs.py:204-210, intel_amx_backend.py
  `IntelAMXMultiStepDraftBackend`). The draft's extend backend is torch_native itself; its DRAFT_EXTEND_V2
  batches (prefix seq_len, num_draft_tokens new tokens, eagle_worker_common.py `prepare_for_draft_extend`)
  run `chain_attention`, which computes the new tokens' rows only.
- the target's verify (TARGET_VERIFY): num_draft_tokens new tokens per request after seq_len cached ones,
  with no extend lengths in the batch (forward_batch_info.py:1226). With top-k 1 the draft tree is a chain
  and its mask is causal (the QLEN_ONLY mask `build_tree_kernel_efficient` lays out is lower-triangular), so
  `forward_extend` runs a causal extend with those lengths (`chain_attention`).
- the draft's set-up: taking the target's embedding and head ends in a CUDA synchronize (`init_lm_head`).
On a hybrid model (Qwen3-Next's MTP draft) the verify's linear-attention layers write each draft token's
state to the state pool's per-draft-token buffers (the shim's conv and recurrent ops), and the accepted step's
state goes back to the request's slot after the verify (`scatter_after_verify`, Triton-only in SGLang).
Trees (top-k > 1) need the tree mask in both forwards; the launcher refuses them on CPU
(refusals/speculative.py). The six `sgl_kernel` ops these forwards call are in the CPU shim.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from sglang.srt.layers.attention import torch_native_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from vamp_sglang.integration.hooks import Hook

TORCH_NATIVE = "torch_native"


@contextmanager
def lengths(forward_batch: Any, **values: Any):
    """forward_batch with some length fields set for one attention call, then restored: SGLang's batch is
    shared by every layer and step, and its own fields must come back unchanged."""
    saved = {name: getattr(forward_batch, name) for name in values}
    for name, value in values.items():
        setattr(forward_batch, name, value)
    try:
        yield forward_batch
    finally:
        for name, value in saved.items():
            setattr(forward_batch, name, value)


class TorchNativeDraftStep(TorchNativeAttnBackend):
    """torch_native for draft decode step `step`: each query sees its prefix and draft tokens 0..step."""

    def __init__(self, model_runner: Any, step: int) -> None:
        super().__init__(model_runner)
        self.step = step

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        with lengths(forward_batch, seq_lens=forward_batch.seq_lens + self.step + 1):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)


class TorchNativeMultiStepDraftBackend:
    """The per-step container the EAGLE worker drives (`attn_backends[i]` runs draft step i)."""

    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int) -> None:
        if topk != 1:
            raise ValueError(f"torch_native drafts chains only (--speculative-eagle-topk 1, got {topk})")
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [TorchNativeDraftStep(model_runner, step)
                              for step in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch: Any) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)


def create_backend(original, factory: Any, backend_name: str, backend_map: dict, error_template: str,
                   stamps_children: bool = False) -> Any:
    """Around `DraftBackendFactory._create_backend`: its map gains torch_native (the multi-step container
    for the draft decode map, which alone stamps children; torch_native itself for the draft extend)."""
    runner = factory.draft_model_runner

    def multi_step():
        steps = factory.speculative_num_steps
        return TORCH_NATIVE, TorchNativeMultiStepDraftBackend(runner, factory.topk, steps)

    def extend():  # the class the attention registry builds (cpu/parallel.py may have replaced it)
        return TORCH_NATIVE, torch_native_backend.TorchNativeAttnBackend(runner)

    entries = {TORCH_NATIVE: multi_step if stamps_children else extend}
    return original(factory, backend_name, backend_map | entries, error_template, stamps_children)


def forward_extend(original, backend: Any, q, k, v, layer, forward_batch: Any, save_kv_cache: bool = True):
    """Around torch_native's `forward_extend`: a TARGET_VERIFY batch is a causal extend of its draft tokens
    (num_draft_tokens each) after seq_len cached ones, and it and the draft extend (DRAFT_EXTEND_V2) run
    `chain_attention` (torch_native's own extend, with the verify's lengths, where the layer is not plain causal);
    every other batch is unchanged."""
    mode = forward_batch.forward_mode
    if not (mode.is_target_verify() or mode.is_draft_extend_v2()):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache)
    attend = chain_attention if _plain_causal(backend, layer, forward_batch) else original
    if mode.is_draft_extend_v2():
        return attend(backend, q, k, v, layer, forward_batch, save_kv_cache)
    seq_lens = forward_batch.seq_lens
    draft_tokens = torch.full_like(seq_lens, forward_batch.spec_info.draft_token_num)
    with lengths(forward_batch, extend_prefix_lens=seq_lens, extend_seq_lens=draft_tokens,
                 seq_lens=seq_lens + draft_tokens):
        return attend(backend, q, k, v, layer, forward_batch, save_kv_cache)


def _plain_causal(backend: Any, layer: Any, forward_batch: Any) -> bool:
    """Self-attention with a plain causal mask (no sliding window, cross attention or encoder), the one
    `chain_attention` computes; the rest keeps torch_native's own extend."""
    window = layer.sliding_window_size
    return (not layer.is_cross_attention and layer.attn_type != AttentionType.ENCODER_ONLY
            and (window is None or window <= -1) and forward_batch.encoder_lens is None
            and not backend.use_sliding_window_kv_pool)


def chain_attention(backend: Any, q, k, v, layer, forward_batch: Any, save_kv_cache: bool = True):
    """Causal attention of each request's new tokens (the last `extend_seq_lens` of its `seq_lens` columns)
    over its prefix and themselves: new x seq_len scores per request and layer. torch_native's extend lays a
    query row for every cached token too and computes seq_len x seq_len of them: a verify of 4 draft tokens
    after 2,000 cached ones did 500 times the work, and a decode step's cost grew with the square of the
    contexts it held (the bench's TPOT with the draft, docs/speculative.md). Query r of n new tokens in a
    request of L sees columns 0..L - n + r, the mask the chain's lower-triangular verify mask extends."""
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    heads = layer.tp_q_head_num
    query = q.view(-1, heads, layer.qk_head_dim).movedim(0, 1)  # [heads, tokens, dim]
    out = q.new_empty((q.shape[0], heads * layer.v_head_dim))
    out_heads = out.view(-1, heads, layer.v_head_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    table = backend.req_to_token_pool.req_to_token
    start = 0
    for request, total, new in zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist(),
                                   forward_batch.extend_seq_lens.tolist(), strict=True):
        rows = table[request, :total]
        key, value = (cache[rows].movedim(0, 1).to(query.dtype) for cache in (k_cache, v_cache))
        visible = torch.arange(total) <= torch.arange(total - new, total).unsqueeze(1)
        attended = torch.nn.functional.scaled_dot_product_attention(
            query[:, start:start + new].unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), attn_mask=visible,
            scale=layer.scaling, enable_gqa=heads != layer.tp_k_head_num)
        out_heads[start:start + new] = attended.squeeze(0).movedim(1, 0)
        start += new
    return out


def init_lm_head(original, worker: Any) -> None:
    """Around `EagleDraftWorker.init_lm_head`: the draft shares the target's embedding and head through the
    model's `set_embed_and_head`, which ends in `torch.cuda.synchronize()` in most models (deepseek_v2.py:
    3442-3448 and a dozen others) and fails without a CUDA driver; on CPU there is no queue to wait for."""
    with mock.patch.object(torch.cuda, "synchronize", lambda device=None: None):
        original(worker)


def scatter_after_verify(mamba_caches: Any, state_indices: torch.Tensor, last_correct_step_indices: torch.Tensor,
                         mamba_track_indices: torch.Tensor | None, mamba_steps_to_track: torch.Tensor | None,
                         src_indices_raw: torch.Tensor | None = None) -> None:
    """Replaces `scatter_mamba_states_after_mtp_verify` (kernels/ops/mamba/mamba_state_scatter_triton.py:
    781-848, CUDA/XPU kernels): the recurrent state and every conv window of each request's last accepted
    draft step go to its state slot (and to its track slot where one crosses an interval), through SGLang's
    own torch gather-scatter (`HybridLinearAttnBackend._scatter_speculative_state_with_mask`)."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    scatter = HybridLinearAttnBackend._scatter_speculative_state_with_mask
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm),
             *zip(mamba_caches.conv, mamba_caches.intermediate_conv_window, strict=True)]
    targets = [(state_indices, last_correct_step_indices)]
    if mamba_track_indices is not None:
        targets.append((mamba_track_indices, mamba_steps_to_track))
    for dst_indices, steps in targets:
        for dst, src in pairs:
            if dst.numel() > 0:
                scatter(dst, src, dst_indices, steps, src_indices_raw)


HOOKS = [
    Hook("sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head", "around", init_lm_head,
         "CPU mode, EAGLE/NEXTN: the draft takes the target's embedding and head without a CUDA synchronize"),
    Hook("sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend", "around", create_backend,
         "CPU mode, EAGLE/NEXTN: the draft's decode and extend backends exist for torch_native (per-step "
         "lengths over the draft chain)"),
    Hook("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend", "around",
         forward_extend,
         "CPU mode, EAGLE/NEXTN: the target's verify and the draft extend attend for the chain's rows only"),
    Hook("sglang.srt.layers.attention.hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify", "replace",
         scatter_after_verify,
         "CPU mode, NEXTN on Qwen3-Next: the accepted draft step's linear-attention state goes back to its slot"),
]
