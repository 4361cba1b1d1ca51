"""The capacity planner's `--hicache-gib` (issue 22): per ratio the device and host KV tokens, the host memory
both tiers take, and the two link costs at the stated bandwidth."""

import json

import pytest

from vamp_sglang.capacity.__main__ import main

QWEN3_NEXT = ["--model", "qwen3-next-80b-a3b-fp8", "--gpu-mem-gib", "80", "--tp", "2", "--h2d-gbps", "50"]


def _report(capsys, *flags):
    assert main([*QWEN3_NEXT, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hicache_section_per_ratio(capsys):
    report = _report(capsys, "--hicache-gib", "64", "--ratios", "0.1,0.2")
    h, geo = report["hicache"], report["geometry"]
    assert h["host_tokens"] == 64 * 2**30 // geo["kv_bytes_per_token"] and h["h2d_gbps"] == 50
    assert h["load_ms_per_1k_hit_tokens"] == pytest.approx(geo["kv_bytes_per_token"] * 1000 / 50e9 * 1e3, rel=1e-3)
    rows = h["ratios"]
    assert list(rows) == ["0", "0.1", "0.2"]
    assert rows["0"]["device_tokens"] == report["baseline"]["kv_pool_tokens"]
    assert rows["0.2"]["device_tokens"] == report["ratios"]["0.2"]["kv_pool_tokens"] > rows["0"]["device_tokens"]
    assert rows["0.2"]["staging_ms_per_decode_step"] > rows["0.1"]["staging_ms_per_decode_step"] > 0
    assert rows["0.2"]["host_gib_per_gpu"] == pytest.approx(64 + report["ratios"]["0.2"]["reclaimed_gib_per_gpu"],
                                                            abs=1e-3)


def test_the_table_states_the_assumed_bandwidth_and_no_flag_no_section(capsys):
    assert main([*QWEN3_NEXT, "--hicache-gib", "64"]) == 0
    assert "HiCache: 64.0 GiB host pool per GPU" in capsys.readouterr().out
    assert "hicache" not in _report(capsys)
