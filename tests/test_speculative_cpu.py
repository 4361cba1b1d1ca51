"""CPU mode's EAGLE/NEXTN attention (vamp_sglang/cpu/speculative.py) and its launcher refusal, no server.

A draft chain of 4 tokens after a cached prefix, two requests of different lengths, on torch_native with a
small hand-built KV pool: the target's verify (one causal extend over the chain) and each draft decode step
(step i sees the prefix and chain tokens 0..i) give what torch_native's plain decode gives token by token,
which is what a model without speculation computes. Tree drafts are refused on CPU, naming the flag.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention import torch_native_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from vamp_sglang.cpu import speculative
from vamp_sglang.launch_server import ConfigError, prepare

HEADS, KV_HEADS, DIM, CHAIN, ROWS, COLUMNS = 4, 2, 8, 4, 64, 32
PREFIX = [5, 3]  # cached tokens per request before the chain


class Pool:
    """The three calls torch_native makes on a KV pool, over one layer's K and V rows."""

    def __init__(self) -> None:
        self.k = torch.zeros(ROWS, KV_HEADS, DIM)
        self.v = torch.zeros(ROWS, KV_HEADS, DIM)

    def set_kv_buffer(self, layer, loc, k, v) -> None:
        self.k[loc.loc] = k.view(-1, KV_HEADS, DIM)
        self.v[loc.loc] = v.view(-1, KV_HEADS, DIM)

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


@pytest.fixture()
def setup():
    """Prefix KV at scattered rows; each request's chain slots follow its prefix in its req->token row."""
    gen = torch.Generator().manual_seed(0)
    pool = Pool()
    table = torch.zeros(4, COLUMNS, dtype=torch.int64)
    rows = torch.randperm(ROWS, generator=gen)
    req_pool_indices = torch.tensor([2, 0])
    used = 0
    for request, prefix in zip(req_pool_indices.tolist(), PREFIX, strict=True):
        table[request, :prefix + CHAIN] = rows[used:used + prefix + CHAIN]
        pool.k[rows[used:used + prefix]] = torch.randn(prefix, KV_HEADS, DIM, generator=gen)
        pool.v[rows[used:used + prefix]] = torch.randn(prefix, KV_HEADS, DIM, generator=gen)
        used += prefix + CHAIN
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=table),
                             token_to_kv_pool=pool)
    layer = SimpleNamespace(tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM,
                            layer_id=0, scaling=DIM ** -0.5, is_cross_attention=False,
                            attn_type=AttentionType.DECODER, sliding_window_size=None)
    chain = [table[r, p:p + CHAIN] for r, p in zip(req_pool_indices.tolist(), PREFIX, strict=True)]
    q, k, v = (torch.randn(2, CHAIN, heads * DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
    return SimpleNamespace(runner=runner, layer=layer, pool=pool, table=table, rpi=req_pool_indices,
                           chain=chain, q=q, k=k, v=v)


def batch(s, mode, seq_lens, out_cache_loc, **fields):
    return SimpleNamespace(forward_mode=mode, seq_lens=torch.tensor(seq_lens), req_pool_indices=s.rpi,
                           out_cache_loc=out_cache_loc, encoder_lens=None, extend_prefix_lens=None,
                           extend_seq_lens=None, **fields)


def token_by_token(s) -> torch.Tensor:
    """torch_native's plain decode, one chain token at a time: [request, token, heads * dim]."""
    backend = TorchNativeAttnBackend(s.runner)
    out = torch.empty(2, CHAIN, HEADS * DIM)
    for i in range(CHAIN):
        fb = batch(s, ForwardMode.DECODE, [p + i + 1 for p in PREFIX], torch.stack([c[i] for c in s.chain]))
        out[:, i] = backend.forward_decode(s.q[:, i], s.k[:, i], s.v[:, i], s.layer, fb)
    return out


def test_verify_is_a_causal_extend_of_the_chain(setup):
    s = setup
    expected = token_by_token(s)
    s.pool.k[torch.cat(s.chain)] = 0  # the verify writes the chain's KV itself
    backend = TorchNativeAttnBackend(s.runner)
    fb = batch(s, ForwardMode.TARGET_VERIFY, PREFIX, torch.cat(s.chain),
               spec_info=SimpleNamespace(draft_token_num=CHAIN))
    q, k, v = (t.reshape(2 * CHAIN, -1) for t in (s.q, s.k, s.v))
    out = speculative.forward_extend(TorchNativeAttnBackend.forward_extend, backend, q, k, v, s.layer, fb)
    torch.testing.assert_close(out.view(2, CHAIN, -1), expected)
    assert fb.seq_lens.tolist() == PREFIX and fb.extend_seq_lens is None  # the batch comes back unchanged


def test_a_verify_chain_attention_does_not_take_runs_torch_natives_extend_with_the_verify_lengths(setup):
    """A sliding-window layer keeps torch_native's own extend (its window mask), which needs the verify's
    prefix and extend lengths set as for `chain_attention`: a window wider than every sequence changes
    nothing, so the outputs equal plain decoding."""
    s = setup
    expected = token_by_token(s)
    s.layer.sliding_window_size = 1000
    s.pool.k[torch.cat(s.chain)] = 0
    fb = batch(s, ForwardMode.TARGET_VERIFY, PREFIX, torch.cat(s.chain),
               spec_info=SimpleNamespace(draft_token_num=CHAIN))
    q, k, v = (t.reshape(2 * CHAIN, -1) for t in (s.q, s.k, s.v))
    out = speculative.forward_extend(TorchNativeAttnBackend.forward_extend, TorchNativeAttnBackend(s.runner),
                                     q, k, v, s.layer, fb)
    torch.testing.assert_close(out.view(2, CHAIN, -1), expected)


def attention_query_rows(monkeypatch) -> list[int]:
    """The query rows of every SDPA call torch_native or the speculative module makes from now on."""
    rows = []

    def recording(query, *args, **kwargs):
        rows.append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch_native_backend, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return rows


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2],
                         ids=["verify", "draft_extend"])
def test_speculative_extends_attend_for_the_chain_rows_only(setup, monkeypatch, mode):
    """The verify and the draft extend compute CHAIN query rows per request, not one per cached token too
    (torch_native's extend does: a seq_len x seq_len product per request and layer, so a step's cost grew
    with the square of the context and a 2,000-token prefix cost 500 times a 4-token chain's work)."""
    s = setup
    expected = token_by_token(s)
    s.pool.k[torch.cat(s.chain)] = 0
    if mode.is_target_verify():
        fb = batch(s, mode, PREFIX, torch.cat(s.chain), spec_info=SimpleNamespace(draft_token_num=CHAIN))
    else:  # the draft extend's batch carries its lengths (eagle_worker_common.prepare_for_draft_extend)
        fb = batch(s, mode, [p + CHAIN for p in PREFIX], torch.cat(s.chain))
        fb.extend_prefix_lens, fb.extend_seq_lens = torch.tensor(PREFIX), torch.full((2,), CHAIN)
    rows = attention_query_rows(monkeypatch)
    q, k, v = (t.reshape(2 * CHAIN, -1) for t in (s.q, s.k, s.v))
    out = speculative.forward_extend(TorchNativeAttnBackend.forward_extend, TorchNativeAttnBackend(s.runner),
                                     q, k, v, s.layer, fb)
    torch.testing.assert_close(out.view(2, CHAIN, -1), expected)
    assert rows == [CHAIN, CHAIN]


def test_draft_steps_see_prefix_and_chain_so_far(setup):
    s = setup
    expected = token_by_token(s)
    draft = speculative.TorchNativeMultiStepDraftBackend(s.runner, topk=1, speculative_num_steps=CHAIN + 1)
    assert [b.step for b in draft.attn_backends] == list(range(CHAIN))
    fb = batch(s, ForwardMode.DECODE, PREFIX, None)  # the draft batch keeps the committed lengths
    draft.init_forward_metadata(fb)
    for i, backend in enumerate(draft.attn_backends):
        fb.out_cache_loc = torch.stack([c[i] for c in s.chain])
        torch.testing.assert_close(backend.forward_decode(s.q[:, i], s.k[:, i], s.v[:, i], s.layer, fb),
                                   expected[:, i])
        assert fb.seq_lens.tolist() == PREFIX


def test_other_extends_run_unchanged_and_trees_are_not_drafted(setup):
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    assert speculative.forward_extend(lambda *a: a, "backend", "q", "k", "v", "layer", fb) == (
        "backend", "q", "k", "v", "layer", fb, True)
    with pytest.raises(ValueError, match="topk 1"):
        speculative.TorchNativeMultiStepDraftBackend(setup.runner, topk=2, speculative_num_steps=3)


def test_draft_factory_gains_torch_native_entries(setup):
    factory = SimpleNamespace(draft_model_runner=setup.runner, topk=1, speculative_num_steps=3)
    seen = {}

    def original(f, name, backend_map, template, stamps_children=False):
        seen[stamps_children] = backend_map[speculative.TORCH_NATIVE]()
        return "built"

    assert speculative.create_backend(original, factory, "decode_attention_backend", {}, "", True) == "built"
    speculative.create_backend(original, factory, "prefill_attention_backend", {}, "")
    assert isinstance(seen[True][1], speculative.TorchNativeMultiStepDraftBackend)
    assert type(seen[False][1]) is TorchNativeAttnBackend


SPEC = ["--model-path", "/nonexistent", "--device", "cpu", "--speculative-algorithm", "EAGLE",
        "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]


@pytest.mark.parametrize("ratio", ["0", "0.2"])
def test_tree_drafts_are_refused_on_cpu_naming_the_flag(ratio):
    with pytest.raises(ConfigError, match="--speculative-eagle-topk 2 is not supported with --device cpu"):
        prepare([*SPEC, "--speculative-eagle-topk", "2", "--vamp-max-offload-ratio", ratio])
    prepare([*SPEC, "--speculative-eagle-topk", "1", "--vamp-max-offload-ratio", "0"])  # chains are served
    prepare([*SPEC[:4], "--device", "cuda", *SPEC[6:], "--speculative-eagle-topk", "2",
             "--vamp-max-offload-ratio", "0"])


def test_a_tree_sglang_would_pick_itself_is_refused_on_cpu(tmp_path):
    """Left out, the top-k is SGLang's choice: 4 (a tree) for Llama and Grok targets, 1 for the rest."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    llama = [*SPEC[:1], str(tmp_path), *SPEC[2:], "--vamp-max-offload-ratio", "0"]
    with pytest.raises(ConfigError, match="--speculative-eagle-topk left out .* LlamaForCausalLM"):
        prepare(llama)
    prepare([*llama, "--speculative-eagle-topk", "1"])
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    prepare(llama)  # SGLang picks top-k 1 for DeepSeek's MTP: a chain


def test_cli_refusal_exits_2_within_a_second():
    started = time.monotonic()
    argv = [*SPEC, "--speculative-eagle-topk", "4", "--vamp-max-offload-ratio", "0"]
    result = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", *argv], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2 and "--speculative-eagle-topk 4" in result.stderr
    assert time.monotonic() - started < 5.0  # a second of ours, plus the interpreter's start on a busy host
