"""Stock serving (ratio 0) of the tiny DeepSeek-V3 and V2 (MLA) through our launcher on CPU, against transformers.

One server per version (the module's fixture; make test-long). With `--device cpu` SGLang's attention is
torch_native, which serves MLA once our CPU hook (vamp_sglang/cpu/mla.py) gives it the absorbed-MLA dispatch.
Greedy tokens must equal transformers' (recomputing each sequence from scratch) for one request, a batch of
different lengths (varlen prefill, batched decode) and a second turn that reuses the first turn's cached
prefix (MLA over the latent rows the radix cache kept).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from eval.servers import Server, ServerConfig, ServerSetup, post_json
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.long]
MODELS = Path(__file__).resolve().parents[1] / "models"
NEW_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def tiny_deepseek(arch: str = "deepseek_v3") -> Path:
    """The shared tiny checkpoint of `arch` under models/ (written once, then reused)."""
    return make_checkpoint(MODELS / f"tiny-{arch.replace('_', '-')}", arch=arch)


class TransformersGreedy:
    """transformers' forward of a checkpoint, greedy, recomputing the whole sequence for every token."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(new_tokens):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]


def prompt_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]  # ids below 10 are special tokens


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def served(request):
    model = tiny_deepseek(request.param)
    setup = ServerSetup(model_path=str(model), max_total_tokens=2048)
    with Server(setup, ServerConfig(request.param, ("--vamp-max-offload-ratio", "0"))) as server:
        yield server, TransformersGreedy(model)


def test_one_request_matches_transformers(served):
    server, reference = served
    prompt = prompt_of(random.Random(1), 40)
    out = post_json(f"{server.url}/generate", {"input_ids": prompt, "sampling_params": GREEDY})
    assert out["output_ids"] == reference.greedy(prompt, NEW_TOKENS)


def test_batch_of_different_lengths_matches_transformers(served):
    server, reference = served
    rng = random.Random(2)
    prompts = [prompt_of(rng, n) for n in (7, 33, 18)]
    outs = post_json(f"{server.url}/generate", {"input_ids": prompts, "sampling_params": GREEDY})
    assert [o["output_ids"] for o in outs] == [reference.greedy(p, NEW_TOKENS) for p in prompts]


def test_second_turn_reuses_the_cached_prefix_and_matches_transformers(served):
    server, reference = served
    rng = random.Random(3)
    first = prompt_of(rng, 30)
    turn1 = post_json(f"{server.url}/generate", {"input_ids": first, "sampling_params": GREEDY})
    second = first + turn1["output_ids"] + prompt_of(rng, 12)
    turn2 = post_json(f"{server.url}/generate", {"input_ids": second, "sampling_params": GREEDY})
    assert turn2["meta_info"]["cached_tokens"] >= len(first)
    assert turn2["output_ids"] == reference.greedy(second, NEW_TOKENS)
