"""VAMP on the tiny DeepSeek-V3 (MLA) through our launcher on CPU, under a multi-turn load its pool cannot hold.

Four servers for the module, one after the other, on the same requests: ratio 0 on a pool large enough that
nothing is evicted (the reference run), then VAMP-10 and VAMP-20 at TP 1 and VAMP-20 at TP 2, each with a
latent pool of POOL_TOKENS while the sessions' final contexts add up to more than twice that. SESSIONS
closed-loop sessions run at once, each turn extending the previous prompt and its answer. Checked:
- every VAMP server grew the latent pool from expert memory (an offload decided, pool past its start size);
- the greedy tokens of every turn are identical in all four runs, and equal transformers' (one teacher-forced
  forward over each session's final context of the reference run);
- at TP 2 both ranks log the same decisions (snapshots, plans, pool sizes);
- the experts VAMP pages are the routed ones of MoE layers 2-5: the dense first layer has no experts, the
  first MoE layer is never eligible (paper V-B), and the shared expert is not in the FusedMoE on CPU.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random

import pytest
import torch

from eval.servers import Server, ServerConfig, ServerSetup, get_json, post_json
from tests.test_deepseek_server import TransformersGreedy, tiny_deepseek

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (several servers)
POOL_TOKENS = 512
# Final context 96 + 5 * (48 + 8) + 8 = 384 tokens a session: one fits the pool, three need 1152.
SESSIONS, TURNS, FIRST_TOKENS, GROWTH_TOKENS, NEW_TOKENS = 3, 6, 96, 48, 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
RUNS = {  # name -> (ratio, tp, pool)
    "ratio0-large": ("0", 1, 8192),
    "vamp10": ("0.1", 1, POOL_TOKENS),
    "vamp20": ("0.2", 1, POOL_TOKENS),
    "vamp20-tp2": ("0.2", 2, POOL_TOKENS),
}


def _session(url: str, seed: int) -> dict:
    rng, ids, turns = random.Random(seed), [], []
    for turn in range(TURNS):
        ids = ids + [rng.randrange(10, 2000) for _ in range(FIRST_TOKENS if turn == 0 else GROWTH_TOKENS)]
        out = post_json(f"{url}/generate", {"input_ids": ids, "sampling_params": GREEDY})
        turns.append({"prompt_tokens": len(ids), "output_ids": out["output_ids"]})
        ids = ids + out["output_ids"]
    return {"context": ids, "turns": turns}


def _serve(model, logs, name: str) -> dict:
    ratio, tp, pool = RUNS[name]
    log = logs / f"decisions-{name}.jsonl"  # rank r > 0 writes log.rank<r>
    setup = ServerSetup(str(model), max_total_tokens=pool, tp_size=tp, log_dir=str(logs))
    flags = ("--vamp-max-offload-ratio", ratio) + (("--vamp-decision-log", str(log)) if ratio != "0" else ())
    with Server(setup, ServerConfig(f"deepseek-v3-{name}", flags)) as server:
        before = get_json(f"{server.url}/vamp/stats")
        with cf.ThreadPoolExecutor(SESSIONS) as workers:
            sessions = list(workers.map(lambda s: _session(server.url, s), range(SESSIONS)))
        return {"sessions": sessions, "before": before, "after": get_json(f"{server.url}/vamp/stats"),
                "logs": [log] + [log.with_name(f"{log.name}.rank{r}") for r in range(1, tp)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = tiny_deepseek("deepseek_v3")
    logs = tmp_path_factory.mktemp("logs")
    return {"model": model} | {name: _serve(model, logs, name) for name in RUNS}


@pytest.mark.parametrize("name", ["vamp10", "vamp20", "vamp20-tp2"])
def test_the_latent_pool_grew_from_expert_memory(runs, name):
    before, after = runs[name]["before"], runs[name]["after"]
    assert before["kv_pool"]["tokens"] == before["kv_pool"]["baseline_tokens"] == POOL_TOKENS
    assert after["kv_pool"]["tokens"] > POOL_TOKENS and after["decisions"]["offload"] >= 1
    experts = after["experts"]
    assert (experts["eligible_layers"], experts["groups_per_layer"] * experts["shards_per_group"]) == (4, 128)


@pytest.mark.parametrize("name", ["vamp10", "vamp20", "vamp20-tp2"])
def test_greedy_outputs_identical_to_the_large_pool_run(runs, name):
    assert [s["context"] for s in runs[name]["sessions"]] == [s["context"] for s in runs["ratio0-large"]["sessions"]]


def test_greedy_tokens_equal_transformers(runs):
    reference = TransformersGreedy(runs["model"])
    for session in runs["ratio0-large"]["sessions"]:
        with torch.no_grad():
            logits = reference.model(torch.tensor([session["context"]])).logits[0]
        predicted = logits.argmax(-1).tolist()
        for turn in session["turns"]:
            start = turn["prompt_tokens"]
            assert turn["output_ids"] == predicted[start - 1:start - 1 + NEW_TOKENS]


def test_tp2_ranks_decide_alike(runs):
    rank0, rank1 = ([json.loads(line) for line in path.read_text().splitlines()] for path in runs["vamp20-tp2"]["logs"])
    assert rank0, "TP 2 made no decision"

    def strip(log):
        return [(d["step"], d["site"], d.get("snapshot"), d["plan"], d["outcome"]) for d in log]

    assert strip(rank0) == strip(rank1)
