"""Residency by routing through real CPU servers (issue 49): the tiny model with routers fitted to the
DeepSeek-V2-Lite trace (`tiny_moe --routing-from`), served twice, `--vamp-expert-order index` and `routing`,
with the same sequential greedy requests (float32). `offload-first` offloads one group at the first KV
shortfall, after the earlier requests' routing was counted. Outputs are identical, and the routing
server's offloaded rows hold each layer's least-routed experts (by its own decayed counts), which take a
smaller share of the selections than the highest-index experts residency by index offloads."""

from pathlib import Path

import pytest

from eval.decode_cost_traces import DATA_DIR
from eval.servers import Server, ServerConfig, ServerSetup, get_json, post_json
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint
from vamp_sglang.tiny_moe.routing import trace_texts

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (two servers and a fitted checkpoint)

DEEPSEEK = DATA_DIR / "deepseek-v2-lite-chat-int8_hf_puffin2000+webglm100_prefill.npz"
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe-routed"
POOL_TOKENS, REQUESTS, TEXTS_PER_PROMPT, NEW_TOKENS = 1024, 10, 8, 24
FLAGS = ("--vamp-max-offload-ratio", "0.5", "--vamp-policy", "offload-first", "--vamp-expand-groups", "1",
         "--vamp-restore-after-steps", "0")


def _serve(setup, order, prompts):
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Server(setup, ServerConfig(order, (*FLAGS, "--vamp-expert-order", order))) as server:
        outputs = [post_json(f"{server.url}/generate", {"text": p, "sampling_params": greedy})["output_ids"]
                   for p in prompts]
        return outputs, get_json(f"{server.url}/vamp/stats")


def routed_model_setup(tmp_path_factory, requests):
    """The fitted tiny model's server setup and `requests` prompts of the trace's held-out texts."""
    if not DEEPSEEK.is_file():
        pytest.skip(f"routing trace {DEEPSEEK} not present")
    model = make_checkpoint(MODEL, routing_from=DEEPSEEK, experts=64, top_k=6)
    texts = trace_texts(DEEPSEEK, 1)
    prompts = [" ".join(texts[i * TEXTS_PER_PROMPT:(i + 1) * TEXTS_PER_PROMPT]) for i in range(requests)]
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, log_dir=str(tmp_path_factory.mktemp("logs")))
    return setup, prompts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    setup, prompts = routed_model_setup(tmp_path_factory, REQUESTS)
    return {order: _serve(setup, order, prompts) for order in ("index", "routing")}


def test_outputs_identical_and_one_group_offloaded_under_either_order(runs):
    (by_index, index_stats), (by_routing, routing_stats) = runs["index"], runs["routing"]
    assert len(by_routing) == REQUESTS and all(len(o) == NEW_TOKENS for o in by_routing)
    assert by_routing == by_index
    assert index_stats["experts"]["offloaded_groups"] == routing_stats["experts"]["offloaded_groups"] >= 1
    assert index_stats["residency"] == {"order": "index"}


def test_the_offloaded_experts_are_the_least_routed(runs):
    residency = runs["routing"][1]["residency"]
    assert residency["order"] == "routing" and residency["layers_without_ids"] == []
    assert residency["swaps"] > 0 and residency["swapped_bytes"] > 0
    assert residency["offloaded_are_coldest"]
    assert residency["offloaded_share"] < residency["offloaded_share_by_index"]
