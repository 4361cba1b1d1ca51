"""The capacity planner's numbers for the tiny model are what a real CPU server reports in /vamp/stats
after offloading the same ratio at start-up (`--vamp-initial-offload-ratio`): exact token counts,
reclaimed bytes, and the bytes each decode step stages (one server for the module)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json, post_json

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-qwen3-moe"  # shared by the server tests
POOL_TOKENS = 2048
RATIO = "0.4"  # 6 of the tiny model's 16 groups per eligible layer: neither a test_server_offload ratio


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = ensure_tiny_model(MODEL)
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, log_dir=str(tmp_path_factory.mktemp("logs")))
    flags = ("--vamp-max-offload-ratio", RATIO, "--vamp-initial-offload-ratio", RATIO,
             "--vamp-restore-after-steps", "0", "--vamp-staging", "whole")  # the planner prices whole staging
    with Server(setup, ServerConfig("capacity", flags)) as server:
        at_start = get_json(f"{server.url}/vamp/stats")
        info = get_json(f"{server.url}/server_info")
        post_json(f"{server.url}/generate", {"input_ids": list(range(10, 74)),
                                             "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        after = get_json(f"{server.url}/vamp/stats")
    return model, info, at_start, after


@pytest.fixture(scope="module")
def planned(served):
    model, info, _, _ = served
    argv = [sys.executable, "-m", "vamp_sglang.capacity", "--model", str(model), "--gpu-mem-gib", "16", "--tp", "1",
            "--max-total-tokens", str(POOL_TOKENS), "--page-size", str(info["page_size"]), "--ratios", RATIO, "--json"]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True, timeout=120).stdout
    return json.loads(out)


def test_pool_tokens_match_the_server_exactly(served, planned):
    _, _, stats, _ = served
    row = planned["ratios"][RATIO]
    assert planned["baseline"]["source"] == "max-total-tokens"
    assert planned["baseline"]["kv_pool_tokens"] == stats["kv_pool"]["baseline_tokens"] == POOL_TOKENS
    assert row["kv_pool_tokens"] == stats["kv_pool"]["tokens"] > POOL_TOKENS
    assert row["kv_pool_tokens"] == stats["kv_pool"]["max_tokens"]  # the ratio is also the server's bound


def test_groups_and_reclaimed_bytes_match_the_server(served, planned):
    _, _, stats, _ = served
    row, geo, experts = planned["ratios"][RATIO], planned["geometry"], stats["experts"]
    assert row["offloaded_groups"] == experts["offloaded_groups"] == experts["max_groups"] == 6
    assert (geo["group_experts"], geo["groups_per_layer"], geo["eligible_layers"]) == (
        experts["shards_per_group"], experts["groups_per_layer"], experts["eligible_layers"])
    assert row["reclaimed_bytes_per_gpu"] == experts["reclaimed_bytes"]
    assert row["offload_ratio"] == pytest.approx(experts["offload_ratio"])


def test_each_forward_stages_the_planned_bytes(served, planned):
    """One staging copy per eligible layer and forward, each the layer's whole offloaded region (IV-D)."""
    _, _, _, after = served
    staging, layers = after["staging"], planned["geometry"]["eligible_layers"]
    assert staging["copies"] > 0 and staging["copies"] % layers == 0
    assert staging["bytes"] == staging["copies"] // layers * planned["ratios"][RATIO]["staged_bytes_per_step"]
