"""The capacity planner under expert parallelism (`--ep N`, SGLang's --ep-size with the standard dispatcher):
each rank holds E / ep routed experts split over tp / ep ranks, and VAMP pages only those."""

import json

import pytest
from test_capacity import DEEPSEEK_H200, _refused, _run

from vamp_sglang.capacity.models import BUILTIN
from vamp_sglang.memory.geometry import geometry_from_config

QWEN_235B_FP8 = ["--model", "qwen3-235b-a22b-fp8", "--gpu-mem-gib", "140"]
MIB = 1 << 20


def test_qwen3_235b_fp8_at_tp8_is_served_with_ep2_each_rank_holding_half_the_experts_at_tp4_width(capsys):
    """SGLang's cookbook runs Qwen3-235B-A22B-FP8 at TP8 with --ep-size 2: alone, TP8 would split each expert's
    1536 intermediate rows 8 ways (192, not a multiple of the 128-row FP8 scale block). With EP2 the experts
    split over tp / ep = 4 ranks (384 rows) and each rank holds 64 of the 128: half TP4's expert bytes, in the
    same 4-expert groups (a w13 shard of 2 x 384 x 4096 bytes = 3 MiB, w2 1.5 MiB: 4 experts are whole 2 MiB
    pages), and a group frees exactly what it frees at TP4."""
    assert "--tp 8" in _refused([*QWEN_235B_FP8, "--tp", "8"], capsys)
    ep = _run([*QWEN_235B_FP8, "--tp", "8", "--ep", "2", "--ratios", "0.1,0.2", "--json"], capsys)
    tp4 = _run([*QWEN_235B_FP8, "--tp", "4", "--ratios", "0.1,0.2", "--json"], capsys)
    g, g4 = ep["geometry"], tp4["geometry"]
    assert (ep["ep"], g["local_experts"], g["routed_experts"], g["moe_intermediate_per_rank"]) == (2, 64, 128, 384)
    assert (g4["local_experts"], g4["moe_intermediate_per_rank"], g["group_experts"]) == (128, 384, 4)
    assert g["expert_gib_per_gpu"] == pytest.approx(g4["expert_gib_per_gpu"] / 2, abs=1e-4)
    for key, groups in (("0.1", 1), ("0.2", 3)):  # VAMP-r of 64 local experts: 6.4 -> 1 group, 12.8 -> 3
        row = ep["ratios"][key]
        assert row["offloaded_groups"] == groups and row["offload_ratio"] == groups * 4 / 64
        assert row["reclaimed_bytes_per_gpu"] == groups * 93 * 4 * (3 + 1.5) * MIB  # 93 eligible layers
        assert row["kv_pool_tokens"] > ep["baseline"]["kv_pool_tokens"]
        assert row["deployment_tokens"] == row["kv_pool_tokens"]  # TP ranks hold the same tokens
    assert ep["ratios"]["0.2"]["reclaimed_bytes_per_gpu"] == tp4["ratios"]["0.1"]["reclaimed_bytes_per_gpu"]


def test_deepseek_v3_tp8_dp8_ep8_holds_32_whole_experts_and_frees_what_tp8_frees(capsys):
    """DeepSeek-V3 at TP8 DP8 EP8: each rank holds 32 whole experts (3 x 2048 x 7168 fp8 bytes = 21 pages
    each, so a group is one expert) instead of an eighth of all 256. VAMP-10 offloads 3 of the 32 (TP8: 3 groups
    of 8 eighths): the same bytes per rank, so the same tokens per DP rank."""
    dp = _run([*DEEPSEEK_H200, "--dp-attention", "--ratios", "0.05,0.1", "--json"], capsys)
    ep = _run([*DEEPSEEK_H200, "--dp-attention", "--ep", "8", "--ratios", "0.05,0.1", "--json"], capsys)
    g = ep["geometry"]
    assert (g["local_experts"], g["routed_experts"], g["moe_intermediate_per_rank"], g["group_experts"]) == \
        (32, 256, 2048, 1)
    assert g["expert_gib_per_gpu"] == dp["geometry"]["expert_gib_per_gpu"]
    assert ep["ratios"]["0.1"]["reclaimed_bytes_per_gpu"] == 3 * 57 * 3 * 2048 * 7168  # 57 eligible layers
    for key in ("0.05", "0.1"):
        e, d = ep["ratios"][key], dp["ratios"][key]
        assert e["reclaimed_bytes_per_gpu"] == d["reclaimed_bytes_per_gpu"]
        assert e["kv_pool_tokens"] == d["kv_pool_tokens"] and e["deployment_tokens"] == 8 * e["kv_pool_tokens"]


def test_the_router_still_scores_every_expert_under_ep():
    v3 = BUILTIN["deepseek-v3"]
    geo = geometry_from_config(v3, 8, "bfloat16", ep_size=8)
    assert (geo.local_experts, geo.routed_experts, geo.moe_intermediate_per_rank) == (32, 256, 2048)
    assert geometry_from_config(v3, 8, "bfloat16").routed_experts == 256


@pytest.mark.parametrize("argv, named", [
    ([*DEEPSEEK_H200, "--ep", "3"], "--ep 3 must divide --tp 8"),
    ([*DEEPSEEK_H200, "--ep", "0"], "--ep"),
    ([*QWEN_235B_FP8, "--tp", "16", "--ep", "2"], "--tp 16 --ep 2"),  # 1536 / 8 = 192 rows: FP8 block
])
def test_an_ep_degree_that_does_not_split_tp_is_refused_naming_ep(argv, named, capsys):
    assert named in _refused(argv, capsys)  # exit 2


def test_an_ep_degree_that_does_not_divide_the_experts_is_refused_naming_ep(tmp_path, capsys):
    """SGLang asserts every EP rank holds as many routed experts (fused_moe_triton/layer.py:414): Mixtral's 8
    experts over 16 ranks do not split."""
    (tmp_path / "config.json").write_text(json.dumps(BUILTIN["mixtral-8x7b"]))
    base = ["--model", str(tmp_path), "--gpu-mem-gib", "80", "--tp", "16"]
    assert "--ep 16: ep_size 16 does not divide the 8 routed experts" in _refused([*base, "--ep", "16"], capsys)
    assert _run([*base, "--ep", "8", "--json"], capsys)["geometry"]["local_experts"] == 1


def test_dp_attention_with_ep_splits_kv_heads_over_attention_tp_without_rechecking_the_experts(capsys):
    """--tp 8 --dp 2 --ep 8 on Qwen3-30B-A3B-FP8: the experts split over tp / ep = 1 rank (768 rows, whole),
    which SGLang accepts; the KV heads split over attention-TP 4. Reading the KV heads from the geometry at
    tp 4 without the ep must not re-run the expert split check (768 / 4 = 192 rows, not a 128-row FP8 block)."""
    qwen = ["--model", "qwen3-30b-a3b-fp8", "--gpu-mem-gib", "80"]
    dp_ep = _run([*qwen, "--tp", "8", "--dp", "2", "--ep", "8", "--json"], capsys)
    dp = geometry_from_config(BUILTIN["qwen3-30b-a3b-fp8"], 4, "bfloat16", 4)
    assert dp_ep["geometry"]["moe_intermediate_per_rank"] == 768
    assert dp_ep["geometry"]["kv_bytes_per_token"] == dp.kv_bytes_per_token
    assert dp_ep["baseline"]["deployment_tokens"] == 2 * dp_ep["baseline"]["kv_pool_tokens"]  # 2 DP ranks
