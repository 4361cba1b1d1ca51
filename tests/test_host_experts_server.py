"""`--vamp-staging host` through real CPU servers (issue 49): the tiny model with routers fitted to the
DeepSeek-V2-Lite trace, half its offloadable experts offloaded at start-up, served with whole staging and
with the cold experts computed from the host copies (float32, greedy, the same sequential requests). The
host half is added to the kernel's output in another order than the kernel sums its slots: tokens must be
identical and their logprobs within 1e-5."""

import pytest
from test_residency_server import routed_model_setup

from eval.servers import Server, ServerConfig, get_json, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (two servers)

REQUESTS, NEW_TOKENS = 6, 16
FLAGS = ("--vamp-max-offload-ratio", "0.5", "--vamp-initial-offload-ratio", "0.5", "--vamp-restore-after-steps", "0")


def _serve(setup, staging, prompts):
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Server(setup, ServerConfig(staging, (*FLAGS, "--vamp-staging", staging))) as server:
        answers = [post_json(f"{server.url}/generate", {"text": p, "sampling_params": greedy, "return_logprob": True})
                   for p in prompts]
        return ([a["output_ids"] for a in answers], [[t[0] for t in a["meta_info"]["output_token_logprobs"]]
                                                     for a in answers], get_json(f"{server.url}/vamp/stats"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    setup, prompts = routed_model_setup(tmp_path_factory, REQUESTS)
    return {staging: _serve(setup, staging, prompts) for staging in ("whole", "host")}


def test_host_computed_experts_give_whole_stagings_outputs(runs):
    (whole_ids, whole_lp, _), (host_ids, host_lp, _) = runs["whole"], runs["host"]
    assert host_ids == whole_ids and all(len(o) == NEW_TOKENS for o in host_ids)
    deltas = [abs(a - b) for want, got in zip(whole_lp, host_lp) for a, b in zip(want, got)]
    assert len(deltas) == REQUESTS * NEW_TOKENS and max(deltas) <= 1e-5


def test_stats_report_host_pairs_and_no_staged_bytes(runs):
    whole, host = runs["whole"][2], runs["host"][2]
    assert whole["experts"]["offloaded_groups"] == host["experts"]["offloaded_groups"] >= 1
    assert host["host_experts"]["pairs"] > 0 and host["host_experts"]["pairs_per_step"] > 0
    assert host["staging"]["bytes"] == 0 and whole["staging"]["bytes"] > 0
    assert "host_experts" not in whole
