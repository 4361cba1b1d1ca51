"""Residency by routing and host-computed cold experts under TP 2 through real CPU servers (issue 49).

The tiny model fitted to the DeepSeek-V2-Lite trace (`tiny_moe --routing-from`), float32, greedy, served at
TP 2 twice with the same sequential requests in two phases with an idle pause between them: at ratio 0, and
with VAMP-25 on a small pool (`offload-first`, `--vamp-expert-order routing`, `--vamp-staging host`; at TP 2
a rank's pages hold 16 of a layer's 64 expert shards, 4 groups, so VAMP-20 would offload none). The VAMP
server offloads a group at the first shortfall of each phase and restores it in the pause (10 s idle), so
the routing counts, summed over both ranks inside each transaction, reorder the experts twice. Each rank
publishes its own digest of the expert order (`vamp:residency_order_digest`, labelled by TP rank): both
ranks' are equal after the offload, after the restore and after the second offload. Each rank computes
its shard's partial sum of the cold experts on the host and the all-reduce adds the two ranks' halves: the
tokens are those of ratio 0, which whole staging reproduces by construction (it runs the same kernel over
the same rows). A third server with `--vamp-staging whole` fits no 3-minute budget here (each TP 2 server
takes 45-65 s to start on this machine); docs/staging.md has its one run."""

import dataclasses
import json
import time
from pathlib import Path

import pytest
from test_parallel_modes_server import per_rank
from test_residency_server import routed_model_setup

from eval.servers import Server, ServerConfig, get_json, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (two TP 2 servers)

PHASE_REQUESTS, NEW_TOKENS, RESTORE_WAIT_S = 4, 16, 90.0
VAMP_25 = ("--vamp-max-offload-ratio", "0.25", "--vamp-policy", "offload-first", "--vamp-expand-groups", "1",
           "--vamp-restore-after-steps", "100000", "--vamp-expert-order", "routing")
CONFIGS = {"ratio0": ("--vamp-max-offload-ratio", "0"),
           "host": (*VAMP_25, "--vamp-staging", "host")}


def observe(url: str) -> dict:
    """`/vamp/stats` (rank 0's) and every rank's order digest, read after the stats request made each
    rank publish its series (every rank answers SGLang's internal-state request)."""
    stats = get_json(f"{url}/vamp/stats")
    return {"stats": stats, "digests": per_rank(url, "vamp:residency_order_digest")}


def wait_for_restore(url: str) -> dict:
    """Poll until the offloaded group came back (the idle restore), then observe."""
    deadline = time.monotonic() + RESTORE_WAIT_S
    while get_json(f"{url}/vamp/stats")["experts"]["offloaded_groups"] and time.monotonic() < deadline:
        time.sleep(1.0)
    return observe(url)


def serve(setup, name, prompts) -> dict:
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Server(setup, ServerConfig(name, CONFIGS[name])) as server:
        def generate(batch):
            return [post_json(f"{server.url}/generate", {"text": p, "sampling_params": greedy})["output_ids"]
                    for p in batch]

        started = time.monotonic()
        outputs = generate(prompts[:PHASE_REQUESTS])
        if name == "ratio0":
            return {"outputs": outputs + generate(prompts[PHASE_REQUESTS:])}
        seen = {"offloaded": observe(server.url), "restored": wait_for_restore(server.url)}
        outputs += generate(prompts[PHASE_REQUESTS:])
        seen["offloaded_again"] = observe(server.url)
        return {"outputs": outputs, "seen": seen, "wall_s": time.monotonic() - started}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    setup, prompts = routed_model_setup(tmp_path_factory, 2 * PHASE_REQUESTS)
    setup = dataclasses.replace(setup, tp_size=2)
    runs = {name: serve(setup, name, prompts) for name in CONFIGS}
    (Path(setup.log_dir) / "runs.json").write_text(json.dumps(runs))  # beside the servers' logs
    return runs


def test_outputs_under_routing_order_and_host_experts_are_those_of_ratio_0(runs):
    reference = runs["ratio0"]["outputs"]
    assert len(reference) == 2 * PHASE_REQUESTS and all(len(o) == NEW_TOKENS for o in reference)
    assert runs["host"]["outputs"] == reference


def test_both_ranks_hold_the_same_order_after_each_offload_and_restore(runs):
    seen = runs["host"]["seen"]
    offloaded, restored, again = (seen[k]["stats"] for k in ("offloaded", "restored", "offloaded_again"))
    assert offloaded["experts"]["offloaded_groups"] == again["experts"]["offloaded_groups"] == 1
    assert restored["experts"]["offloaded_groups"] == 0 and restored["decisions"]["restore"] == 1
    assert again["decisions"]["offload"] == 2
    for moment in seen.values():
        digests = moment["digests"]
        assert set(digests) == {0, 1} and digests[0] == digests[1]
        assert digests[0] == moment["stats"]["residency"]["order_digest"]
    assert offloaded["residency"]["swaps"] > 0, "the offload reordered nothing"


def test_the_offloaded_rows_hold_fewer_selections_than_index_orders_would(runs):
    for moment in ("offloaded", "offloaded_again"):
        residency = runs["host"]["seen"][moment]["stats"]["residency"]
        assert residency["order"] == "routing" and residency["layers_without_ids"] == []
        assert residency["offloaded_are_coldest"]
        assert residency["offloaded_share"] < residency["offloaded_share_by_index"]


def test_each_rank_computes_the_cold_experts_on_the_host_and_stages_nothing(runs):
    first, second = (runs["host"]["seen"][k]["stats"] for k in ("offloaded", "offloaded_again"))
    assert 0 < first["host_experts"]["pairs"] < second["host_experts"]["pairs"]
    assert second["staging"]["bytes"] == 0 and second["staging"]["policy"] == "host"
