"""The capacity planner's numbers for the tiny model are what a real CPU server reports in /vamp/stats
after offloading the same ratio at start-up (`--vamp-initial-offload-ratio`): exact token counts,
reclaimed bytes, and the bytes each decode step stages (one server for the module)."""

import json
import subprocess
import sys
import urllib.error
import urllib.request
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
        update = _post_status(f"{server.url}/update_weights_from_disk", {"model_path": str(model)})
        served_after = post_json(f"{server.url}/generate", {
            "input_ids": list(range(10, 30)), "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    return model, info, at_start, after, (update, served_after)


def _post_status(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def planned(served):
    model, info, *_ = served
    argv = [sys.executable, "-m", "vamp_sglang.capacity", "--model", str(model), "--gpu-mem-gib", "16", "--tp", "1",
            "--max-total-tokens", str(POOL_TOKENS), "--page-size", str(info["page_size"]), "--ratios", RATIO, "--json"]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True, timeout=120).stdout
    return json.loads(out)


def test_pool_tokens_match_the_server_exactly(served, planned):
    _, _, stats, *_ = served
    row = planned["ratios"][RATIO]
    assert planned["baseline"]["source"] == "max-total-tokens"
    assert planned["baseline"]["kv_pool_tokens"] == stats["kv_pool"]["baseline_tokens"] == POOL_TOKENS
    assert row["kv_pool_tokens"] == stats["kv_pool"]["tokens"] > POOL_TOKENS
    assert row["kv_pool_tokens"] == stats["kv_pool"]["max_tokens"]  # the ratio is also the server's bound


def test_groups_and_reclaimed_bytes_match_the_server(served, planned):
    _, _, stats, *_ = served
    row, geo, experts = planned["ratios"][RATIO], planned["geometry"], stats["experts"]
    assert row["offloaded_groups"] == experts["offloaded_groups"] == experts["max_groups"] == 6
    assert (geo["group_experts"], geo["groups_per_layer"], geo["eligible_layers"]) == (
        experts["shards_per_group"], experts["groups_per_layer"], experts["eligible_layers"])
    assert row["reclaimed_bytes_per_gpu"] == experts["reclaimed_bytes"]
    assert row["offload_ratio"] == pytest.approx(experts["offload_ratio"])


def test_each_forward_stages_the_planned_bytes(served, planned):
    """One staging copy per eligible layer and forward, each the layer's whole offloaded region (IV-D)."""
    _, _, _, after, _ = served
    staging, layers = after["staging"], planned["geometry"]["eligible_layers"]
    assert staging["copies"] > 0 and staging["copies"] % layers == 0
    assert staging["bytes"] == staging["copies"] // layers * planned["ratios"][RATIO]["staged_bytes_per_step"]


def test_a_weight_update_is_refused_with_the_reason_and_the_server_serves_on(served):
    """Issue 48 defect 9: an in-place weight update would leave the offloaded experts' host copies stale."""
    *_, ((status, answer), generated) = served
    assert status == 400 and answer["success"] is False
    assert "update_weights_from_disk is refused while VAMP pages the MoE experts" in answer["message"]
    assert len(generated["output_ids"]) == 4
