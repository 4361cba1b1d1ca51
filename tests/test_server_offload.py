"""Through the real server: greedy output is token-for-token identical whatever fraction of experts is
offloaded, and the pool SGLang schedules from grows by what the experts gave up.

One module, four servers started one after another (under /tmp/vamp-server.lock): VAMP off
(`--vamp-max-offload-ratio 0`), then 10%, 25% and the maximum offloaded at start-up. Every server gets
the same requests: a batch of four prompts first (admitted together into the empty pool), then
sequential single prompts of random token ids (distinct first tokens, so no prefix is shared and each
request's shapes are the same in every run). They need more KV than the start-up pool holds: the
VAMP-off server evicts, the grown servers keep everything, so rows above the start-up pool serve KV.
"""

import json
import random
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (several servers each)

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"  # shared by the server tests

POOL_TOKENS = 2048
CONTEXT_TOKENS = 16384  # the tiny model's max_position_embeddings
MAX_RATIO = 0.75  # the maximum tested: 12 of the tiny model's 16 groups (8 experts each) per layer
PROMPT_TOKENS, NEW_TOKENS, SEQUENTIAL = 300, 24, 10
RUNS = {  # name -> (initial ratio, offloaded groups expected: floor(ratio * 128 / 8))
    "off": (None, 0),
    "r10": (0.10, 1),
    "r25": (0.25, 4),
    "max": (MAX_RATIO, 12),
}




def _workload(vocab_size):
    rng = random.Random(0)
    firsts = rng.sample(range(10, vocab_size), 4 + SEQUENTIAL)
    return [[first] + [rng.randrange(10, vocab_size) for _ in range(PROMPT_TOKENS - 1)] for first in firsts]


def _serve(setup, name, initial_ratio, prompts):
    flags = ["--vamp-max-offload-ratio", "0"] if initial_ratio is None else [
        "--vamp-max-offload-ratio", str(MAX_RATIO), "--vamp-initial-offload-ratio", str(initial_ratio),
        "--vamp-restore-after-steps", "0"]
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Server(setup, ServerConfig(name, tuple(flags))) as server:
        stats_before = get_json(f"{server.url}/vamp/stats")
        batch = post_json(f"{server.url}/generate", {"input_ids": prompts[:4], "sampling_params": greedy})
        outputs = [r["output_ids"] for r in batch]
        for prompt in prompts[4:]:
            outputs.append(post_json(f"{server.url}/generate", {"input_ids": prompt, "sampling_params": greedy})["output_ids"])
        return outputs, stats_before, get_json(f"{server.url}/vamp/stats")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = ensure_tiny_model(MODEL)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, log_dir=str(tmp_path_factory.mktemp("logs")))
    prompts = _workload(vocab_size)
    return {name: _serve(setup, name, ratio, prompts) for name, (ratio, _) in RUNS.items()}


@pytest.mark.parametrize("name", ["r10", "r25", "max"])
def test_greedy_output_identical_to_vamp_off(runs, name):
    reference, outputs = runs["off"][0], runs[name][0]
    assert len(outputs) == 4 + SEQUENTIAL and all(len(o) == NEW_TOKENS for o in outputs)
    for i, (want, got) in enumerate(zip(reference, outputs)):
        assert got == want, f"request {i} differs with {name} offloaded"


@pytest.mark.parametrize("name", ["r10", "r25", "max"])
def test_stats_show_experts_offloaded_and_the_pool_grown(runs, name):
    _, before, after = runs[name]
    groups = RUNS[name][1]
    experts, pool = before["experts"], before["kv_pool"]
    assert (experts["offloaded_groups"], experts["groups_per_layer"], experts["shards_per_group"]) == (groups, 16, 8)
    assert experts["eligible_layers"] == 5 and experts["max_groups"] == 12
    assert experts["offload_ratio"] == pytest.approx(groups * 8 / 128)
    assert experts["reclaimed_bytes"] == groups * 5 * 8 * (512 + 256) * 1024
    assert pool["baseline_tokens"] == POOL_TOKENS < pool["tokens"] <= pool["max_tokens"]
    copies = {k: v for k, v in pool["size_snapshots"].items() if not k.endswith(("max_req_len", "max_req_input_len"))}
    assert set(copies.values()) == {pool["tokens"]}, f"a copy of the pool size was not updated: {copies}"
    assert pool["size_snapshots"]["scheduler.max_req_len"] == min(CONTEXT_TOKENS, pool["tokens"]) - 1
    assert after["staging"]["bytes"] > 0 and after["experts"]["offloaded_groups"] >= groups
    modes = after["staging"]["modes"]  # the default --vamp-staging auto: every mode counted, summing up
    assert after["staging"]["policy"] == "auto" and set(modes) == {"whole", "routed", "host"}
    assert modes["routed"]["steps"] > 0  # each token bucket's second step tries routed: the hook passed T
    assert sum(mode["steps"] for mode in modes.values()) == after["staging"]["steps"]
    assert modes["whole"]["bytes"] + modes["routed"]["bytes"] == after["staging"]["bytes"]
    assert modes["host"]["bytes"] == 0 and modes["host"]["steps"] > 0  # the CPU server's auto tries host too
    assert after["radix"]["cached_tokens"] > POOL_TOKENS, "no KV id above the start-up pool was used"
    assert "mirror_lost" not in after["radix"]  # the tree's order followed a growing pool to the end


def test_vamp_off_keeps_the_stock_pool(runs):
    _, before, after = runs["off"]
    assert before["kv_pool"]["tokens"] == before["kv_pool"]["baseline_tokens"] == POOL_TOKENS
    assert after["kv_pool"]["tokens"] == POOL_TOKENS and after["radix"]["cached_tokens"] <= POOL_TOKENS
    assert before["experts"]["offload_ratio"] == 0.0 and "offloaded_groups" not in before["experts"]
