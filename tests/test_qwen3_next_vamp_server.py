"""VAMP-20 on the tiny Qwen3-Next through our launcher on CPU, under a multi-turn load its pool cannot hold.

Two servers for the module, one after the other, at TP 1 and TP 2: VAMP-20 with a full-attention pool of
POOL_TOKENS, while the sessions' final contexts add up to more than twice that. SESSIONS closed-loop
sessions run at once, each turn extending the previous prompt and its answer. With the pool grown from
expert memory, on both servers:
- the full-attention pool is past its start size and an offload was decided;
- every turn after the first resumes from the state checkpoint its previous turn left at finish (cached
  tokens = the whole previous context but its last token), which the start pool alone cannot do: at
  ratio 0 the same load evicts, and a turn whose checkpoint went starts over or from an older one;
- the greedy tokens of every turn equal `vamp_sglang.tiny_next_reference`, checked with one
  teacher-forced forward over each session's final context;
- `/vamp/stats` shows both pools with live values.
At TP 2 both ranks log the same decisions (snapshots, plans, pool sizes) and the outputs equal TP 1's.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import random
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, get_json, post_json
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint
from vamp_sglang.tiny_next_reference import TinyNextReference

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (several servers each)
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-next"
POOL_TOKENS = 512
# Final context 96 + 5 * (48 + 8) + 8 = 384 tokens a session: one fits the pool, three need 1152.
SESSIONS, TURNS, FIRST_TOKENS, GROWTH_TOKENS, NEW_TOKENS = 3, 6, 96, 48, 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def _session(url: str, seed: int) -> dict:
    """One closed-loop session; per turn the prompt length and the cached tokens SGLang reported."""
    rng, ids, turns = random.Random(seed), [], []
    for turn in range(TURNS):
        ids = ids + [rng.randrange(10, 2000) for _ in range(FIRST_TOKENS if turn == 0 else GROWTH_TOKENS)]
        out = post_json(f"{url}/generate", {"input_ids": ids, "sampling_params": GREEDY})
        turns.append({"prompt_tokens": len(ids), "cached_tokens": out["meta_info"]["cached_tokens"],
                      "output_ids": out["output_ids"]})
        ids = ids + out["output_ids"]
    return {"context": ids, "turns": turns}


def _serve(model: Path, logs: Path, tp_size: int) -> dict:
    log = logs / f"decisions-tp{tp_size}.jsonl"  # rank r > 0 writes log.rank<r>
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, tp_size=tp_size, log_dir=str(logs))
    flags = ("--vamp-max-offload-ratio", "0.2", "--vamp-decision-log", str(log))
    with Server(setup, ServerConfig(f"qwen3-next-vamp-20-tp{tp_size}", flags)) as server:
        before = get_json(f"{server.url}/vamp/stats")
        with cf.ThreadPoolExecutor(SESSIONS) as pool:
            sessions = list(pool.map(lambda s: _session(server.url, s), range(SESSIONS)))
        return {"sessions": sessions, "before": before, "after": get_json(f"{server.url}/vamp/stats"),
                "logs": [log] + [log.with_name(f"{log.name}.rank{r}") for r in range(1, tp_size)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = make_checkpoint(MODEL, arch="qwen3_next")
    logs = tmp_path_factory.mktemp("logs")
    return {"model": model, "tp1": _serve(model, logs, 1), "tp2": _serve(model, logs, 2)}


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_full_attention_pool_grew_from_experts(runs, tp):
    run = runs[tp]
    kv, decisions = run["after"]["kv_pool"], run["after"]["decisions"]
    assert run["before"]["kv_pool"]["tokens"] == kv["baseline_tokens"] == POOL_TOKENS
    assert kv["tokens"] > POOL_TOKENS
    assert decisions["offload"] + decisions["combined"] >= 1
    assert run["after"]["experts"]["offloaded_groups"] >= 1


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_every_turn_resumes_from_the_previous_turns_checkpoint(runs, tp):
    for session in runs[tp]["sessions"]:
        turns = session["turns"]
        assert turns[0]["cached_tokens"] == 0
        for prev, turn in itertools.pairwise(turns):
            assert turn["cached_tokens"] == prev["prompt_tokens"] + NEW_TOKENS - 1


def test_greedy_tokens_equal_the_plain_torch_reference(runs):
    reference = TinyNextReference(runs["model"])
    for session in runs["tp1"]["sessions"]:
        predicted = reference.logits(session["context"][:-1]).argmax(-1).tolist()
        for turn in session["turns"]:
            start = turn["prompt_tokens"]  # the turn's answer follows its prompt in the final context
            assert turn["output_ids"] == predicted[start - 1:start - 1 + NEW_TOKENS]


def test_tp2_outputs_equal_tp1(runs):
    assert [s["context"] for s in runs["tp2"]["sessions"]] == [s["context"] for s in runs["tp1"]["sessions"]]


def test_tp2_ranks_decide_alike(runs):
    """Every input of a plan (the tree's candidates, the agreed gains) and every outcome (pool sizes) is
    equal on both ranks, so a rank-local view of the hybrid tree or of either pool would show here."""
    rank0, rank1 = ([json.loads(line) for line in path.read_text().splitlines()] for path in runs["tp2"]["logs"])
    assert rank0, "TP 2 made no decision"

    def strip(log):
        return [(d["step"], d["site"], d.get("snapshot"), d["plan"], d["outcome"]) for d in log]

    assert strip(rank0) == strip(rank1)


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_stats_show_both_pools_live(runs, tp):
    before, after = runs[tp]["before"], runs[tp]["after"]
    assert after["step"] > before["step"]
    state = after["state_pool"]
    assert state["grows_from_experts"] is True and state["buffer_rows"] >= state["slots"] + 1
    assert state["free_slots"] < state["slots"]
    assert 0 < state["cached_states"] == state["evictable_states"]  # idle: nothing running holds a state
    assert after["kv_pool"]["free_tokens"] < after["kv_pool"]["tokens"]
