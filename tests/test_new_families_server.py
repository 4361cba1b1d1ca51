"""VAMP on the tiny checkpoints of the families served besides Qwen3-MoE, Qwen3-Next and DeepSeek (issue 47).

For each family two servers through our launcher on CPU, one at a time, on the same multi-turn requests (the
sessions of tests/test_deepseek_vamp_server.py: 3 at once, 6 turns of 8 greedy tokens, 384 tokens each at the
end): ratio 0 on a pool large enough that nothing is evicted (the reference run), then VAMP-20 on a pool of
POOL_TOKENS, which the three final contexts exceed more than twice. Checked per family:
- the reference run's greedy tokens equal transformers' (one teacher-forced forward over each session's final
  context: each turn's tokens are the argmax at the positions before them);
- VAMP-20 grew the pool from expert memory (an offload decided, the KV pool past its start size, and for a
  hybrid model the linear-attention state pool too when a state shortfall came) and its greedy tokens equal
  the reference run's.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest
import torch

from eval.servers import Server, ServerConfig, ServerSetup, get_json
from tests.test_deepseek_vamp_server import NEW_TOKENS, POOL_TOKENS, SESSIONS, _session
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (two servers per family)
MODELS = Path(__file__).resolve().parents[1] / "models"
ARCHS = ["mixtral", "glm4_moe"]
RUNS = {"ratio0-large": ("0", 8192), "vamp20": ("0.2", POOL_TOKENS)}  # name -> (ratio, pool tokens)


def _serve(model: Path, arch: str, name: str) -> dict:
    ratio, pool = RUNS[name]
    setup = ServerSetup(str(model), max_total_tokens=pool)
    with Server(setup, ServerConfig(f"{arch}-{name}", ("--vamp-max-offload-ratio", ratio))) as server:
        before = get_json(f"{server.url}/vamp/stats")
        with cf.ThreadPoolExecutor(SESSIONS) as workers:
            sessions = list(workers.map(lambda s: _session(server.url, s), range(SESSIONS)))
        return {"sessions": sessions, "before": before, "after": get_json(f"{server.url}/vamp/stats")}


@pytest.fixture(scope="module", params=ARCHS)
def runs(request):
    arch = request.param
    model = make_checkpoint(MODELS / f"tiny-{arch.replace('_', '-')}", arch=arch)
    return {"arch": arch, "model": model} | {name: _serve(model, arch, name) for name in RUNS}


def test_reference_run_equals_transformers(runs):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32).eval()
    for session in runs["ratio0-large"]["sessions"]:
        with torch.no_grad():
            predicted = reference(torch.tensor([session["context"]])).logits[0].argmax(-1).tolist()
        for turn in session["turns"]:
            start = turn["prompt_tokens"]
            assert turn["output_ids"] == predicted[start - 1:start - 1 + NEW_TOKENS]


def test_vamp20_grew_the_pool_from_expert_memory(runs):
    before, after = runs["vamp20"]["before"], runs["vamp20"]["after"]
    assert before["kv_pool"]["tokens"] == before["kv_pool"]["baseline_tokens"] == POOL_TOKENS
    assert after["kv_pool"]["tokens"] > POOL_TOKENS and after["decisions"]["offload"] >= 1


def test_vamp20_greedy_outputs_equal_the_reference_run(runs):
    assert [s["context"] for s in runs["vamp20"]["sessions"]] == [
        s["context"] for s in runs["ratio0-large"]["sessions"]]
