"""Expert, data-attention and pipeline parallelism through our launcher on CPU (make test-long).

At ratio 0 (stock SGLang with our CPU hooks, vamp_sglang/cpu/parallel.py) TP2+EP2, DP2 (DP attention),
DP2+EP2 and PP2 serve the tiny Qwen3-MoE, and DP2+EP2 and PP2 the tiny DeepSeek-V3 (MLA), in float32 with the
greedy tokens of TP 1:
transformers' forward, which TP 1 reproduces (tests/test_deepseek_server.py, tests/test_tiny_moe.py), is the
reference, so no TP 1 server is started. Eight prompts of mixed lengths arrive at once, as separate requests,
so under DP attention the DP controller's round robin sends them to both DP ranks (each reply names its
`dp_rank`). With VAMP on (VAMP-20) at TP2+EP2 a multi-session load over a small pool makes both ranks
offload their own experts, with the same decisions on both ranks and the outputs of ratio 0.
One server at a time (the server lock), each stopped before the next starts.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import random
import urllib.request
from pathlib import Path

import pytest
import torch

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json, post_json
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.long]

MODELS = Path(__file__).resolve().parents[1] / "models"
NEW_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
PROMPT_TOKENS = (5, 41, 17, 90, 9, 63, 28, 120)
MODES = {
    "tp2-ep2": ("--tp-size", "2", "--ep-size", "2"),
    "dp2": ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"),
    "dp2-ep2": ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"),
    "pp2": ("--pp-size", "2"),
}
# DeepSeek-V3 (MLA, a shared expert, group-limited routing) runs the modes that take all three CPU hooks and
# the pipeline; DP2 and TP2+EP2 alone each take a subset of DP2+EP2's hooks, served on Qwen3-MoE.
CASES = [("qwen3_moe", mode) for mode in MODES] + [("deepseek_v3", "dp2-ep2"), ("deepseek_v3", "pp2")]
VAMP_20 = ("--vamp-max-offload-ratio", "0.2", "--vamp-restore-after-steps", "100000")
SESSIONS, TURNS, SMALL_POOL = 4, 5, 1024


def model_path(arch: str) -> Path:
    if arch == "qwen3_moe":
        return ensure_tiny_model(MODELS / "tiny-qwen3-moe")
    return make_checkpoint(MODELS / f"tiny-{arch.replace('_', '-')}", arch=arch)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(10, 2000) for _ in range(n)] for n in PROMPT_TOKENS]


@functools.cache
def reference(arch: str) -> tuple[list[int], ...]:
    """transformers' greedy tokens of every prompt (recomputing the whole sequence for each token)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path(arch), dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts():
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outputs.append(ids[len(prompt):])
    return tuple(outputs)


def generate_at_once(url: str, batch: list[list[int]]) -> list[dict]:
    with cf.ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda p: post_json(f"{url}/generate", {"input_ids": p, "sampling_params": GREEDY}),
                             batch))


@pytest.mark.parametrize("arch, mode", CASES)
def test_ratio_0_gives_the_greedy_tokens_of_tp_1(arch, mode, tmp_path):
    setup = ServerSetup(model_path=str(model_path(arch)), max_total_tokens=2048, log_dir=str(tmp_path))
    with Server(setup, ServerConfig(f"{arch}-{mode}", ("--vamp-max-offload-ratio", "0", *MODES[mode]))) as server:
        replies = generate_at_once(server.url, prompts())
    assert [r["output_ids"] for r in replies] == list(reference(arch))
    if "--enable-dp-attention" in MODES[mode]:
        assert {r["meta_info"]["dp_rank"] for r in replies} == {0, 1}


# ---- VAMP-20 with expert parallelism ---------------------------------------------------------------------

def session(url: str, seed: int) -> list[list[int]]:
    """One closed-loop session: each turn extends the last prompt and its answer by 96 new tokens."""
    rng, ids, answers = random.Random(seed), [], []
    for _ in range(TURNS):
        ids += [rng.randrange(10, 2000) for _ in range(256 if not ids else 96)]
        out = post_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 12}})
        answers.append(out["output_ids"])
        ids = ids + out["output_ids"]
    return answers


def per_rank(url: str, name: str) -> dict[int, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        lines = [line for line in response.read().decode().splitlines() if line.startswith(name + "{")]
    return {int(line.split('tp_rank="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1]) for line in lines}


def serve_sessions(flags: tuple[str, ...], name: str, log_dir: Path) -> dict:
    setup = ServerSetup(model_path=str(model_path("qwen3_moe")), max_total_tokens=SMALL_POOL, log_dir=str(log_dir))
    with Server(setup, ServerConfig(name, (*MODES["tp2-ep2"], "--enable-metrics", *flags))) as server:
        with cf.ThreadPoolExecutor(SESSIONS) as pool:
            answers = list(pool.map(lambda s: session(server.url, s), range(SESSIONS)))
        return {"answers": answers, "stats": get_json(f"{server.url}/vamp/stats"),
                "ratio": per_rank(server.url, "vamp:expert_offload_ratio"),
                "pool": per_rank(server.url, "vamp:kv_pool_tokens")}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ep-vamp")
    log = logs / "decisions.jsonl"
    return {"stock": serve_sessions(("--vamp-max-offload-ratio", "0"), "ep-stock", logs),
            "vamp": serve_sessions((*VAMP_20, "--vamp-decision-log", str(log)), "ep-vamp20", logs),
            "logs": (log, Path(f"{log}.rank1"))}


def test_vamp_20_on_ep_2_offloads_on_both_ranks_and_keeps_the_outputs(ep_runs):
    vamp = ep_runs["vamp"]
    assert vamp["answers"] == ep_runs["stock"]["answers"]
    assert set(vamp["ratio"]) == {0, 1} and min(vamp["ratio"].values()) > 0
    assert vamp["pool"][0] == vamp["pool"][1] > SMALL_POOL
    assert vamp["stats"]["experts"]["offloaded_groups"] >= 1


def test_both_ep_ranks_log_the_same_decisions(ep_runs):
    rank0, rank1 = ([json.loads(line) for line in path.read_text().splitlines()] for path in ep_runs["logs"])
    assert any(d["outcome"].get("tokens_added") for d in rank0), "no offload decided"

    def strip(log):
        return [(d["step"], d["site"], d.get("snapshot"), d["plan"], d["outcome"]) for d in log]

    assert strip(rank0) == strip(rank1)
