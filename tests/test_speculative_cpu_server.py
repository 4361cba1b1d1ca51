"""EAGLE with the tiny DeepSeek-V3's MTP draft on CPU servers at ratio 0 (docs/speculative.md, test-long).

`--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1
--speculative-num-draft-tokens 4` (NEXTN is SGLang's alias of EAGLE), float32, one server at a time:
- the tiny DeepSeek-V3 as written: its MTP layer's weights are random, so almost no draft matches the
  random target; its greedy outputs must equal transformers' for the same checkpoint (which the plain
  server's are, tests/test_deepseek_server.py);
- the same checkpoint with a draft that agrees (`vamp_sglang.tiny_moe.agreeing_draft`), served with and
  without EAGLE: most drafts are accepted, some partly, so the accepted-token paths (the verify's later
  chain positions, the accepted cache locations, the draft extend over accepted tokens) decide the outputs,
  which must equal the plain server's;
- the tiny Qwen3-MoE with its EAGLE3 draft (`--eagle3-draft`, random weights), `--speculative-algorithm
  EAGLE3` with the same chain: its greedy outputs must equal transformers'.
Prompts of several lengths one at a time, batched, and a second turn that reuses a cached prefix. The
accept lengths SGLang measures are printed; the test asserts tokens, and acceptance only where the draft was
built to agree.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, post_json
from tests.test_deepseek_server import MODELS, TransformersGreedy, tiny_deepseek
from vamp_sglang.tiny_moe.agreeing_draft import write_agreeing_draft
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint
from vamp_sglang.tiny_moe.eagle3 import write_eagle3_draft

pytestmark = [pytest.mark.server, pytest.mark.long]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
CHAIN = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4")
EAGLE = ("--speculative-algorithm", "EAGLE", *CHAIN)
LENGTHS = (5, 17, 40, 9)


def prompt_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]  # ids below 10 are special tokens


def prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    return [prompt_of(rng, n) for n in LENGTHS], prompt_of(rng, 12)


def serve_and_collect(model: Path, flags: tuple[str, ...]) -> dict:
    """Every request of the test on one server: singles, one batch, and a second turn on prompt 2's prefix."""
    singles_in, tail = prompts()
    setup = ServerSetup(model_path=str(model), max_total_tokens=2048)
    name = "eagle" if flags else "plain"
    with Server(setup, ServerConfig(name, ("--vamp-max-offload-ratio", "0", *flags))) as server:
        generate = f"{server.url}/generate"
        singles = [post_json(generate, {"input_ids": p, "sampling_params": GREEDY}) for p in singles_in]
        batch = post_json(generate, {"input_ids": singles_in, "sampling_params": GREEDY})
        second = singles_in[2] + singles[2]["output_ids"] + tail
        turn2 = post_json(generate, {"input_ids": second, "sampling_params": GREEDY})
    return {"singles": [s["output_ids"] for s in singles], "batch": [b["output_ids"] for b in batch],
            "second": second, "turn2": turn2["output_ids"], "cached": turn2["meta_info"]["cached_tokens"],
            "meta": [s["meta_info"] for s in singles]}


def accept_lengths(run: dict) -> list[float]:
    return [round(m["spec_accept_length"], 3) for m in run["meta"]]


@pytest.fixture(scope="module")
def as_written():
    model = tiny_deepseek("deepseek_v3")
    return serve_and_collect(model, EAGLE), TransformersGreedy(model)


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    out = tmp_path_factory.mktemp("agree") / "tiny-deepseek-v3"
    model = write_agreeing_draft(tiny_deepseek("deepseek_v3"), out)
    return serve_and_collect(model, ()), serve_and_collect(model, EAGLE)


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    target = make_checkpoint(MODELS / "tiny-qwen3-moe", arch="qwen3_moe")
    draft = write_eagle3_draft(target, tmp_path_factory.mktemp("eagle3") / "draft")
    flags = ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft), *CHAIN)
    return serve_and_collect(target, flags), TransformersGreedy(target)


def assert_same_tokens(eagle: dict, singles: list[list[int]], turn2: list[int]) -> None:
    assert eagle["singles"] == singles and all(len(o) == GREEDY["max_new_tokens"] for o in singles)
    assert eagle["batch"] == singles
    assert eagle["cached"] >= LENGTHS[2] and eagle["turn2"] == turn2  # the second turn hit the cache


def assert_transformers_tokens(eagle: dict, reference: TransformersGreedy) -> None:
    """The speculative server's tokens against transformers' greedy decoding of the same requests; every
    request verified drafts (3 per verify, each verify committing at least the target's own token)."""
    new = GREEDY["max_new_tokens"]
    expected = [reference.greedy(p, new) for p in prompts()[0]]
    assert_same_tokens(eagle, expected, reference.greedy(eagle["second"], new))
    for meta in eagle["meta"]:
        assert meta["spec_verify_ct"] >= 1 and meta["spec_num_proposed_drafts"] == 3 * meta["spec_verify_ct"]


def test_random_draft_outputs_equal_transformers(as_written):
    assert_transformers_tokens(*as_written)
    print(f"random MTP draft, accept length per request: {accept_lengths(as_written[0])}")


def test_agreeing_draft_is_accepted_and_outputs_equal_the_plain_server(agreeing):
    plain, eagle = agreeing
    assert all(not m.get("spec_verify_ct") for m in plain["meta"])
    assert_same_tokens(eagle, plain["singles"], plain["turn2"])
    assert sum(m["spec_num_correct_drafts"] for m in eagle["meta"]) > len(LENGTHS)  # drafts were accepted
    print(f"agreeing MTP draft, accept length per request: {accept_lengths(eagle)}")


def test_eagle3_draft_outputs_equal_transformers(eagle3):
    assert_transformers_tokens(*eagle3)
    print(f"random EAGLE3 draft (Qwen3-MoE), accept length per request: {accept_lengths(eagle3[0])}")
