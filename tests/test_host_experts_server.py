"""`--vamp-staging host` and the server's `auto` through real CPU servers (issue 49): the tiny model with
routers fitted to the DeepSeek-V2-Lite trace, half its offloadable experts offloaded at start-up, served
with whole staging, routed staging, the cold experts computed from the host copies, and auto (which picks
among the three per step), each with the same sequential greedy requests (float32). The host half is
added to the kernel's output in another order than the kernel sums its slots: tokens must be identical and
their logprobs within 1e-5.

What the servers count is checked against the decode-cost bench's accounting for the same routing
(eval/decode_cost_server.py: the same tokens through the same weights in transformers, grouped into the
steps a server serving the requests one at a time runs): whole staging's bytes exactly, routed staging's
bytes and the host's pairs within 5 %; SGLang's warm-up request is not counted."""

import pytest
from test_residency_server import routed_model_setup
from transformers import AutoTokenizer

from eval.decode_cost_server import predict_served
from eval.servers import Server, ServerConfig, get_json, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (four servers)

REQUESTS, NEW_TOKENS, RATIO = 6, 16, 0.5
FLAGS = ("--vamp-max-offload-ratio", str(RATIO), "--vamp-initial-offload-ratio", str(RATIO),
         "--vamp-restore-after-steps", "0")
MODES = ("whole", "routed", "host", "auto")


def _serve(setup, staging, prompts):
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Server(setup, ServerConfig(staging, (*FLAGS, "--vamp-staging", staging))) as server:
        answers = [post_json(f"{server.url}/generate", {"input_ids": p, "sampling_params": greedy,
                                                         "return_logprob": True}) for p in prompts]
        return {"ids": [a["output_ids"] for a in answers],
                "logprobs": [[t[0] for t in a["meta_info"]["output_token_logprobs"]] for a in answers],
                "cached": [a["meta_info"]["cached_tokens"] for a in answers],
                "stats": get_json(f"{server.url}/vamp/stats")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    setup, texts = routed_model_setup(tmp_path_factory, REQUESTS)
    tokenizer = AutoTokenizer.from_pretrained(setup.model_path)
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    runs = {staging: _serve(setup, staging, prompts) for staging in MODES}
    whole = runs["whole"]
    predicted = predict_served(setup.model_path, RATIO, list(zip(prompts, whole["cached"], whole["ids"])))
    return runs, predicted


def test_every_staging_mode_gives_whole_stagings_outputs(served):
    runs, _ = served
    whole = runs["whole"]
    assert all(len(o) == NEW_TOKENS for o in whole["ids"]) and len(whole["ids"]) == REQUESTS
    for staging in MODES[1:]:
        assert runs[staging]["ids"] == whole["ids"], staging
        deltas = [abs(a - b) for want, got in zip(whole["logprobs"], runs[staging]["logprobs"])
                  for a, b in zip(want, got)]
        assert len(deltas) == REQUESTS * NEW_TOKENS and max(deltas) <= 1e-5, staging


def test_the_servers_count_what_the_bench_predicts_for_the_same_routing(served):
    runs, predicted = served
    stats = {staging: runs[staging]["stats"] for staging in MODES}
    for staging in MODES:  # the warm-up request is excluded: the served steps are the requests' steps
        experts = stats[staging]["experts"]
        assert experts["offloaded_groups"] * experts["shards_per_group"] == predicted["offloaded_experts"]
        assert stats[staging]["staging"]["steps"] == predicted["steps"], staging
    assert stats["whole"]["staging"]["bytes"] == predicted["whole_bytes"]
    routed = stats["routed"]["staging"]["modes"]["routed"]["bytes"]
    assert routed == pytest.approx(predicted["routed_bytes"], rel=0.05)
    host = stats["host"]["host_experts"]
    assert host["pairs"] == pytest.approx(predicted["host_pairs"], rel=0.05)
    assert host["steps"] == predicted["steps"] and host["pairs_per_step"] == round(host["pairs"] / host["steps"], 3)
    assert stats["host"]["staging"]["bytes"] == 0 and "host_experts" not in stats["whole"]
    print(f"\nserved {predicted['steps']} steps; routed bytes {routed} (predicted {predicted['routed_bytes']}), "
          f"host pairs {host['pairs']} (predicted {predicted['host_pairs']}), whole bytes {predicted['whole_bytes']}, "
          f"auto modes {stats['auto']['staging']['modes']}")


def test_auto_computes_cold_experts_on_the_host_in_some_steps(served):
    runs, predicted = served
    staging = runs["auto"]["stats"]["staging"]
    modes = staging["modes"]
    assert staging["policy"] == "auto" and sum(m["steps"] for m in modes.values()) == predicted["steps"]
    assert modes["host"]["steps"] > 0 and modes["host"]["bytes"] == 0
    assert runs["auto"]["stats"]["host_experts"]["steps"] == modes["host"]["steps"]
