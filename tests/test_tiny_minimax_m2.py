"""`tiny_moe --arch minimax_m2` and the CPU-mode QK norm that SGLang's MiniMaxM2ForCausalLM runs on it.

The checkpoint: transformers' MiniMaxM2ForCausalLM (the reference of tests/test_minimax_m2_server.py) loads
every tensor, none missing or left over, and the config carries what only SGLang reads. The hook
(`triton_free.qk_norm_in_torch`, in place of SGLang's Triton-only `_forward_naive`) gives transformers'
MiniMaxM2RMSNorm of q and of k: each normalised over all its heads together.
"""

from __future__ import annotations

import json

import pytest
import torch

from vamp_sglang.tiny_moe.checkpoint import make_checkpoint, spec_for

SMALL = {"layers": 2, "experts": 8, "hidden": 64, "intermediate": 32, "heads": 4, "kv_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("minimax_m2"), arch="minimax_m2", seed=1, **SMALL)


def test_config_is_what_sglang_reads(small):
    config = json.loads((small / "config.json").read_text())
    assert config["architectures"] == ["MiniMaxM2ForCausalLM"] and config["model_type"] == "minimax_m2"
    assert (config["rotary_dim"], config["head_dim"], config["rope_theta"]) == (8, 16, 5000000.0)
    assert (config["use_qk_norm"], config["qk_norm_type"]) == (True, "per_layer")
    assert (config["scoring_func"], config["use_routing_bias"], config["num_mtp_modules"]) == ("sigmoid", True, 0)


def test_transformers_loads_every_tensor(small):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    layer = model.model.layers[1]
    assert layer.self_attn.q_norm.weight.shape == (4 * 16,) and layer.self_attn.k_norm.weight.shape == (2 * 16,)
    assert layer.mlp.e_score_correction_bias.abs().max() > 0  # loaded from block_sparse_moe's name
    assert model.model.rotary_emb.inv_freq.numel() == 4  # RoPE on 8 of 16 dims


def test_head_dim_must_allow_half_rotary():
    with pytest.raises(ValueError, match="head_dim=6"):
        spec_for("minimax_m2", head_dim=6).validate()


def _sglang_norm(weight: torch.Tensor, eps: float):
    """SGLang's MiniMaxM2RMSNormTP at attention TP 1, without the parallel state its __init__ reads."""
    from sglang.srt.models.minimax_m2 import MiniMaxM2RMSNormTP

    norm = MiniMaxM2RMSNormTP.__new__(MiniMaxM2RMSNormTP)
    torch.nn.Module.__init__(norm)
    norm.attn_tp_size, norm.variance_epsilon, norm.weight = 1, eps, torch.nn.Parameter(weight)
    return norm


def test_cpu_qk_norm_is_transformers_whole_vector_norm():
    from sglang.srt.models.minimax_m2 import MiniMaxM2QKRMSNorm
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    from vamp_sglang.cpu.triton_free import qk_norm_in_torch

    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(5, dim, generator=generator) * 3 for dim in (64, 32))
    q_weight, k_weight = (1 + torch.randn(dim, generator=generator) * 0.1 for dim in (64, 32))
    impl = MiniMaxM2QKRMSNorm.__new__(MiniMaxM2QKRMSNorm)
    impl._q_norm, impl._k_norm = _sglang_norm(q_weight, 1e-6), _sglang_norm(k_weight, 1e-6)
    with torch.compiler.set_stance("force_eager"):
        got_q, got_k = qk_norm_in_torch(impl, q, k)
    for got, x, weight in ((got_q, q, q_weight), (got_k, k, k_weight)):
        reference = MiniMaxM2RMSNorm(x.shape[-1], eps=1e-6)
        reference.weight.data.copy_(weight)
        torch.testing.assert_close(got, reference(x))
        per_head = x.view(5, -1, 16) * torch.rsqrt(x.view(5, -1, 16).pow(2).mean(-1, keepdim=True) + 1e-6)
        assert not torch.allclose(got, (per_head.reshape(x.shape) * weight))  # not a per-head norm
