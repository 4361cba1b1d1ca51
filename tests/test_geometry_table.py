"""`python -m vamp_sglang.memory.geometry`: the paper's Table II from Qwen3-Next-80B-A3B's config and the
layout rules (first MoE layer resident, groups of whole 2-MiB pages, the VAMP-r bound); pure Python."""

import subprocess
import sys
from pathlib import Path

import pytest

from vamp_sglang.capacity.models import BUILTIN
from vamp_sglang.memory.geometry import GIB, geometry_from_config, reclaim_rows

ROOT = Path(__file__).resolve().parents[1]
TABLE_II = {0.15: (10.5, 18.5), 0.2: (13.8, 21.8)}  # reclaimed, pool GiB per GPU (H100, TP2, from 8.0 GiB)


def test_the_command_prints_table_ii_within_5_percent():
    out = subprocess.run([sys.executable, "-m", "vamp_sglang.memory.geometry", "--model", "qwen3-next-80b-a3b",
                          "--tp", "2", "--ratios", "0.15,0.2"], cwd=ROOT, check=True, capture_output=True,
                         text=True, timeout=60).stdout
    rows = {float(line.split()[0]): [float(x) for x in line.split()[1:]] for line in out.splitlines()[2:]}
    assert rows[0] == [0, 0.0, 8.0]
    for ratio, (reclaimed, pool) in TABLE_II.items():
        assert rows[ratio][1] == pytest.approx(reclaimed, rel=0.05)
        assert rows[ratio][2] == pytest.approx(pool, rel=0.05)


def test_rows_follow_the_layout_rules():
    """Groups of 2 shards = 3 pages (6 MiB) in each of the 47 eligible layers: VAMP-15 is 38 groups
    (76 of 512 experts), VAMP-20 is 51; the 12 full-attention layers' 24 buffers split the pages."""
    geo = geometry_from_config(BUILTIN["qwen3-next-80b-a3b"], 2, "bfloat16")
    assert len(geo.kv_layer_ids) == 12 and len(geo.moe_layer_ids) == 48
    rows = reclaim_rows(geo, [0.15, 0.2], 8 * GIB)
    assert [r.offloaded_groups for r in rows] == [38, 51]
    assert [r.reclaimed_bytes for r in rows] == [g * 3 * 47 * (2 << 20) for g in (38, 51)]
    for r in rows:  # whole pages per buffer: at most the reclaimed bytes, less than one page per buffer short
        assert 0 <= 8 * GIB + r.reclaimed_bytes - r.kv_pool_bytes < 24 * (2 << 20)


def test_a_model_with_a_single_moe_layer_reclaims_nothing():
    """The first MoE layer has no earlier MoE compute to hide its staging behind (V-B)."""
    config = {**BUILTIN["qwen3-next-80b-a3b"], "num_hidden_layers": 4, "mlp_only_layers": [0, 1, 2]}
    row, = reclaim_rows(geometry_from_config(config, 2, "bfloat16"), [0.2], GIB)
    assert (row.offloaded_groups, row.reclaimed_bytes, row.kv_pool_bytes) == (0, 0, GIB)


def test_mla_pages_split_over_one_latent_buffer_per_layer():
    """DeepSeek-V3 at TP8: the pool has 61 latent buffers (not 122 K and V buffers), so each gains
    floor(pages / 61) of the reclaimed pages; fewer than one page per buffer stays spare."""
    geo = geometry_from_config(BUILTIN["deepseek-v3"], 8, "bfloat16")
    assert geo.kv_buffers == len(geo.kv_layer_ids) == 61 and geo.kv_row_bytes == 576 * 2
    row, = reclaim_rows(geo, [0.1], 8 * GIB)
    pages = row.reclaimed_bytes // (2 << 20)
    assert row.kv_pool_bytes - 8 * GIB == pages // 61 * 61 * (2 << 20)
    assert 0 <= 8 * GIB + row.reclaimed_bytes - row.kv_pool_bytes < 61 * (2 << 20)
