"""The capacity planner under DP attention (`--dp N`, `--dp-attention`): MLA's latent per rank is not
replicated across DP ranks, attention weights split over attention-TP only."""

import pytest
from test_capacity import DEEPSEEK_H200, _refused, _run

from vamp_sglang.capacity.models import BUILTIN
from vamp_sglang.capacity.plan import CapacityModel, Deployment
from vamp_sglang.capacity.weights import dense_weight_bytes


def test_dp_attention_keeps_the_mla_latent_per_rank_and_each_dp_rank_holds_distinct_tokens(capsys):
    """DeepSeek-V3 at TP8 with DP8 (attention-TP 1): the experts stay split over TP8 (same groups, same bytes
    reclaimed and staged), the latent row is the same 1152 bytes per layer, so each offloaded group buys the
    same rows per rank; but each of the 8 pools holds its own tokens, so the deployment holds 8 x the tokens.
    Every head's attention weights now sit on every rank, so the start-up pool is smaller than at TP8."""
    tp = _run([*DEEPSEEK_H200, "--ratios", "0.1", "--json"], capsys)
    dp = _run([*DEEPSEEK_H200, "--dp", "8", "--ratios", "0.1", "--json"], capsys)
    assert (dp["dp"], dp["attention_tp"], tp["dp"], tp["attention_tp"]) == (8, 1, 1, 8)
    assert dp["geometry"]["kv_bytes_per_token"] == tp["geometry"]["kv_bytes_per_token"] == 61 * 576 * 2
    assert dp["geometry"]["expert_gib_per_gpu"] == tp["geometry"]["expert_gib_per_gpu"]
    t, d = tp["ratios"]["0.1"], dp["ratios"]["0.1"]
    assert d["reclaimed_bytes_per_gpu"] == t["reclaimed_bytes_per_gpu"] and d["offloaded_groups"] == 3
    assert dp["geometry"]["dense_weight_gib_per_gpu"] > tp["geometry"]["dense_weight_gib_per_gpu"]
    assert dp["baseline"]["kv_pool_tokens"] < tp["baseline"]["kv_pool_tokens"]
    assert t["deployment_tokens"] == t["kv_pool_tokens"]  # TP: every rank holds the same tokens
    assert d["deployment_tokens"] == 8 * d["kv_pool_tokens"] > 6 * t["deployment_tokens"]
    assert _run([*DEEPSEEK_H200, "--dp-attention", "--ratios", "0.1", "--json"], capsys) == dp


def test_dp_attention_splits_only_the_attention_weights_over_attention_tp():
    """DeepSeek-V3 at TP8, DP8: per layer the head-split projections q_b [128 x 192, 1536], kv_b
    [128 x 256, 512] and o_proj [7168, 128 x 128] (fp8, one float32 scale per 128x128 block) are whole on
    every rank instead of an eighth; q_a and kv_a were replicated already, and the rest keeps TP8's split."""
    v3 = BUILTIN["deepseek-v3"]
    elements = 128 * 192 * 1536 + 128 * 256 * 512 + 7168 * 128 * 128
    scales = (192 * 12 - 24 * 12) + (256 * 4 - 32 * 4) + (56 * 128 - 56 * 16)  # q_b, kv_b (column), o (row)
    per_layer = elements * 7 // 8 + scales * 4
    grown = dense_weight_bytes(v3, 8, "bfloat16", attn_tp_size=1) - dense_weight_bytes(v3, 8, "bfloat16")
    assert grown == 61 * per_layer
    assert dense_weight_bytes(v3, 8, "bfloat16", attn_tp_size=8) == dense_weight_bytes(v3, 8, "bfloat16")


def test_dp_attention_splits_mha_kv_heads_over_attention_tp_only():
    # Qwen3-235B: 4 KV heads; at TP4 one per rank, with DP2 (attention-TP 2) two per rank
    q = BUILTIN["qwen3-235b-a22b-fp8"]
    tp4 = CapacityModel.build(q, Deployment(140, 4, "bfloat16"))
    dp2 = CapacityModel.build(q, Deployment(140, 4, "bfloat16", dp=2))
    assert dp2.geometry.kv_bytes_per_token == 2 * tp4.geometry.kv_bytes_per_token
    assert dp2.geometry.local_experts == tp4.geometry.local_experts


@pytest.mark.parametrize("argv, named", [
    ([*DEEPSEEK_H200, "--dp", "3"], "--dp 3 must divide --tp 8"),
    ([*DEEPSEEK_H200, "--dp", "0"], "--dp"),
    ([*DEEPSEEK_H200, "--dp", "2", "--dp-attention"], "--dp-attention means --dp 8"),
])
def test_a_dp_degree_that_does_not_split_tp_is_refused_naming_dp(argv, named, capsys):
    assert named in _refused(argv, capsys)  # exit 2
