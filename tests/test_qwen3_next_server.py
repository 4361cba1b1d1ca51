"""Stock serving (ratio 0) of the tiny Qwen3-Next through our launcher on CPU, against a plain-torch forward.

One server for the module. Greedy tokens must equal `vamp_sglang.tiny_next_reference` (which recomputes
every sequence from scratch) for one request, for a batch of requests of different lengths (varlen
prefill, batched decode), and for a second turn that reuses the first turn's cached prefix and linear-
attention state checkpoint. Multi-turn chat through /v1/chat/completions must work and hit the cache.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, post_json
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint
from vamp_sglang.tiny_next_reference import TinyNextReference

pytestmark = pytest.mark.server
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-next"
NEW_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():
    return make_checkpoint(MODEL, arch="qwen3_next")


@pytest.fixture(scope="module")
def server(model):
    setup = ServerSetup(model_path=str(model), max_total_tokens=2048)
    with Server(setup, ServerConfig("qwen3-next", ("--vamp-max-offload-ratio", "0"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(model):
    return TinyNextReference(model)


def _prompt(rng, n):
    return [rng.randrange(10, 2000) for _ in range(n)]  # ids below 10 are special tokens


def test_one_request_matches_reference(server, reference):
    prompt = _prompt(random.Random(1), 40)
    out = post_json(f"{server.url}/generate", {"input_ids": prompt, "sampling_params": GREEDY})
    assert out["output_ids"] == reference.greedy(prompt, NEW_TOKENS)


def test_batch_of_different_lengths_matches_reference(server, reference):
    rng = random.Random(2)
    prompts = [_prompt(rng, n) for n in (7, 33, 18)]
    outs = post_json(f"{server.url}/generate", {"input_ids": prompts, "sampling_params": GREEDY})
    assert [o["output_ids"] for o in outs] == [reference.greedy(p, NEW_TOKENS) for p in prompts]


def test_second_turn_reuses_cached_state_and_matches_reference(server, reference):
    rng = random.Random(3)
    first = _prompt(rng, 30)
    turn1 = post_json(f"{server.url}/generate", {"input_ids": first, "sampling_params": GREEDY})
    second = first + turn1["output_ids"] + _prompt(rng, 12)
    turn2 = post_json(f"{server.url}/generate", {"input_ids": second, "sampling_params": GREEDY})
    assert turn2["meta_info"]["cached_tokens"] >= len(first)  # resumed from a state checkpoint
    assert turn2["output_ids"] == reference.greedy(second, NEW_TOKENS)


def test_multi_turn_chat_completions(server):
    messages = [{"role": "user", "content": "Good morning! Could you tell me the way to the station?"}]
    usages = []
    for follow_up in ("Thank you. And the library?", "What is the weather like tomorrow?"):
        reply = post_json(f"{server.url}/v1/chat/completions",
                          {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8})
        messages += [reply["choices"][0]["message"], {"role": "user", "content": follow_up}]
        usages.append(reply["usage"])
    assert all(u["completion_tokens"] == 8 for u in usages)
    final = post_json(f"{server.url}/v1/chat/completions",
                      {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8})
    assert final["choices"][0]["message"]["content"]
    assert final["usage"]["prompt_tokens_details"] is None or final["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
