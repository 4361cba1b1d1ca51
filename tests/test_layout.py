"""Expert layout and model geometry arithmetic (paper IV-C, V-A); pure Python."""

import pytest

from vamp_sglang.memory.geometry import GeometryError, geometry_from_config
from vamp_sglang.memory.layout import (
    ExpertLayout,
    LayoutError,
    group_experts_for,
    kv_pages_per_buffer,
    kv_rows_for_bytes,
)

MIB = 1 << 20
QWEN3_NEXT = {"num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 512, "moe_intermediate_size": 512,
              "num_key_value_heads": 2, "head_dim": 256, "num_attention_heads": 16, "full_attention_interval": 4}
QWEN3_30B = {"num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 128, "moe_intermediate_size": 768,
             "num_key_value_heads": 4, "head_dim": 128, "num_attention_heads": 32}


def layout(**overrides):
    args = {"moe_layer_ids": [0, 1, 2, 3], "local_experts": 16, "w13_shard_bytes": 3 * MIB, "w2_shard_bytes": MIB + MIB // 2,
                "granularity_bytes": 2 * MIB, "max_offload_ratio": 0.5, "staging_capacity_shards": 16}
    args.update(overrides)
    return ExpertLayout.compute(**args)


def test_group_size_is_fewest_shards_with_whole_pages_in_both_weights():
    assert group_experts_for(3 * MIB, 3 * MIB // 2, 2 * MIB) == 4  # w2 needs 4 shards, w13 needs 2
    assert group_experts_for(4 * MIB, 2 * MIB, 2 * MIB) == 1
    assert group_experts_for(6 * MIB, 3 * MIB, 2 * MIB) == 2


@pytest.mark.parametrize("tp,shards,pages", [(2, 2, 3), (4, 4, 3)])
def test_qwen3_next_groups_match_the_paper(tp, shards, pages):
    """Paper V-A: a Qwen3-Next group is three 2-MiB pages: 2 shards at TP2, 4 shards at TP4."""
    geo = geometry_from_config(QWEN3_NEXT, tp, "bfloat16")
    lay = ExpertLayout.compute(geo.moe_layer_ids, geo.local_experts, geo.w13_shard_bytes, geo.w2_shard_bytes,
                               2 * MIB, 0.15, geo.local_experts)
    assert (lay.group_experts, lay.pages_per_group_per_layer) == (shards, pages)
    assert lay.eligible_layer_ids == tuple(range(1, 48))
    assert lay.pages_freed_per_group == 3 * 47
    assert lay.bound_groups == int(0.15 * 512 / shards)


def test_bound_is_the_tighter_of_staging_capacity_and_ratio():
    assert layout(max_offload_ratio=0.5, staging_capacity_shards=16).bound_groups == 2  # 8 experts / g=4
    assert layout(max_offload_ratio=0.5, staging_capacity_shards=7).bound_groups == 1  # staging holds 7 < 8
    assert layout(max_offload_ratio=0.2, staging_capacity_shards=16).bound_groups == 0  # 3.2 experts < g
    assert layout(max_offload_ratio=0.0).bound_groups == 0
    assert layout(moe_layer_ids=[5]).bound_groups == 0  # the only MoE layer stays resident


def test_boundary_moves_from_the_top_and_groups_need_not_divide_e():
    lay = layout(local_experts=18, max_offload_ratio=0.9, staging_capacity_shards=18)
    assert (lay.groups_per_layer, lay.always_resident_experts, lay.bound_groups) == (4, 2, 4)
    assert [lay.boundary_expert(n) for n in range(5)] == [18, 14, 10, 6, 2]
    assert lay.offload_ratio(1) == pytest.approx(4 / 18)
    assert lay.groups_for_ratio(0.25) == 1
    assert lay.groups_for_ratio(1.0) == 4
    with pytest.raises(LayoutError, match="offloaded_groups"):
        lay.boundary_expert(5)


def test_freed_bytes_and_tokens_per_group():
    lay = layout()  # g=4: w13 12 MiB = 6 pages, w2 6 MiB = 3 pages, 3 eligible layers
    assert (lay.w13_group_pages, lay.w2_group_pages) == (6, 3)
    assert lay.pages_freed_per_group == 27
    assert lay.bytes_freed_per_group == 54 * MIB
    assert lay.kv_tokens_per_group(96 * 1024) == 54 * MIB // (96 * 1024)
    assert lay.eligible_index(2) == 1 and lay.eligible_index(0) is None


@pytest.mark.parametrize("field,value", [
    ("max_offload_ratio", 1.0), ("max_offload_ratio", -0.1), ("local_experts", 0),
    ("w13_shard_bytes", 0), ("granularity_bytes", -1), ("staging_capacity_shards", -1),
    ("moe_layer_ids", []), ("moe_layer_ids", [2, 1]), ("moe_layer_ids", [1, 1])])
def test_bad_input_names_the_field(field, value):
    with pytest.raises(LayoutError, match=field):
        layout(**{field: value})


def test_kv_page_split_keeps_one_capacity_and_rows_are_whole():
    # 27 pages per group over 8 buffers: 3 pages each after one group, 6 (not 6.75) after two.
    assert [kv_pages_per_buffer(n, 27, 8) for n in range(4)] == [0, 3, 6, 10]
    assert kv_rows_for_bytes(2 * MIB, 3000) == 699  # a page holds no whole number of 3000-byte rows
    assert kv_rows_for_bytes(2 * MIB, 3000, row_multiple=16) == 688


def test_geometry_of_qwen3_30b_and_next():
    geo = geometry_from_config(QWEN3_30B, 1, "bfloat16")
    assert (geo.w13_shard_bytes, geo.w2_shard_bytes) == (6 * MIB, 3 * MIB)
    assert geo.kv_bytes_per_token == 96 * 1024  # research note 3.2
    assert len(geo.moe_layer_ids) == 48 and len(geo.kv_layer_ids) == 48
    nxt = geometry_from_config(QWEN3_NEXT, 4, "bfloat16")
    assert nxt.kv_layer_ids == tuple(range(3, 48, 4))
    assert nxt.kv_heads_per_rank == 1  # 2 heads over 4 ranks: replicated
    assert nxt.kv_bytes_per_token == 2 * 12 * 256 * 2
    mixtral = geometry_from_config({"num_hidden_layers": 32, "hidden_size": 4096, "num_local_experts": 8,
                                    "intermediate_size": 14336, "num_key_value_heads": 8,
                                    "num_attention_heads": 32}, 1, "bfloat16")
    assert (mixtral.w13_shard_bytes, mixtral.head_dim) == (224 * MIB, 128)


def test_geometry_sparse_step_and_errors():
    geo = geometry_from_config(dict(QWEN3_30B, decoder_sparse_step=2, mlp_only_layers=[1]), 1, "float32")
    assert geo.moe_layer_ids == tuple(range(3, 48, 2))
    with pytest.raises(GeometryError, match="tp_size 5"):
        geometry_from_config(QWEN3_30B, 5, "bfloat16")
    with pytest.raises(GeometryError, match="num_experts"):
        geometry_from_config({k: v for k, v in QWEN3_30B.items() if k != "num_experts"}, 1, "bfloat16")
    with pytest.raises(GeometryError, match="dtype"):
        geometry_from_config(QWEN3_30B, 1, "int3")


def test_fused_shared_experts_stay_above_the_offloadable_groups():
    """Issue 19 item 6: SGLang stores fused shared experts as the last local experts; the groups are
    counted from the top of the routed experts below them, and VAMP-r is a fraction of the routed ones."""
    plain, fused = layout(local_experts=16), layout(local_experts=17, fused_shared_experts=1)
    assert (fused.routed_experts, fused.groups_per_layer, fused.bound_groups) == (16, 4, 2)
    assert fused.bound_groups == plain.bound_groups
    assert [fused.boundary_expert(n) for n in range(3)] == [16, 12, 8]
    assert fused.offload_ratio(2) == plain.offload_ratio(2) == 0.5
    assert fused.groups_for_ratio(0.25) == 1 and fused.always_resident_experts == 1
    with pytest.raises(LayoutError, match="fused_shared_experts"):
        layout(fused_shared_experts=16)
