"""Through a real CPU server: a session the client closes gives its KV up first under VAMP's order.

SGLang's radix-native sessions (`--enable-session-radix-cache`): a request that carries a `session_id`
tags the KV it leaves in the tree with its session, and `/close_session` releases the tag. SGLang's
eviction then takes the KV of no open session first, then KV fewer open sessions hold, each by the tree's policy,
here VAMP's (`--radix-cache-backend vamp --radix-eviction-policy vamp`, offloading off so a shortfall
evicts). This is how a server learns that a session ended, which no reuse estimate can know in time
(docs/evaluation.md: with it, VAMP comes within 95 % of the offline optimum on the SWE-agent trace).

Three sessions A, B, C write one turn each; B closes; a one-shot prompt then needs more than the free
pool. The same at TP 2: each rank's scheduler keeps its own tree and session references, so both ranks must take
the same KV and log the same decisions (their plans read each rank's own tree in its eviction order). Without the close, VAMP's order would not pick the middle session first (never-hit KV of one
writer class goes oldest first by p_eff, or newest first while every p_eff is 0 or when expected back),
so B losing its KV while A and C keep theirs is the close at work. VAMP is on (`--vamp-policy
evict-first`, so the shortfall is met by eviction, not by growing the pool): the decision's planner walks
the same session-first order (integration/cache/radix_eviction.py) before SGLang evicts.
"""

import json
import random
import urllib.request
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (two servers: TP 1 and TP 2)
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"
POOL_TOKENS = 2048
TURN_TOKENS, NEW_TOKENS = 400, 8  # three sessions hold ~1,224 tokens of the pool
# more than the ~824 tokens left free: one session's KV must go. Each session's KV is a 400-token prompt and a 7-token
# answer node; the shortfall (~280 tokens) must stay between 7 and ~407 tokens, or A's or C's answer goes too
ONE_SHOT_TOKENS = 1100
FLAGS = ("--vamp-max-offload-ratio", "0.15", "--vamp-policy", "evict-first", "--enable-session-radix-cache")


def _close_session(url: str, session_id: str) -> None:
    body = json.dumps({"session_id": session_id}).encode()
    request = urllib.request.Request(f"{url}/close_session", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def _metric(url: str, name: str, rank: int) -> float | None:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        values = [float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                  if line.startswith(name + "{") and f'tp_rank="{rank}"' in line]
    return sum(values) if values else None


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def second_turns(request, tmp_path_factory):
    tp_size = request.param
    model = ensure_tiny_model(MODEL)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(10, vocab_size) for _ in range(n)]  # ids below 10 are special tokens
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    logs = tmp_path_factory.mktemp("logs")
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, tp_size=tp_size, log_dir=str(logs))
    decision_log = logs / "decisions.jsonl"
    flags = (*FLAGS, "--vamp-decision-log", str(decision_log))
    with Server(setup, ServerConfig(f"vamp-sessions-tp{tp_size}", flags)) as server:
        url = server.url
        histories = {}
        for session in "ABC":
            prompt = draw(TURN_TOKENS)
            out = post_json(f"{url}/generate", {"input_ids": prompt, "sampling_params": greedy,
                                                "session_id": session})
            histories[session] = prompt + out["output_ids"]
        _close_session(url, "B")
        one_shot = post_json(f"{url}/generate", {"input_ids": draw(ONE_SHOT_TOKENS), "sampling_params": greedy})
        cached = {}
        for session in "ACB":  # B last: its turn must not evict A's or C's KV before they are read
            body = {"input_ids": histories[session] + draw(16), "sampling_params": greedy}
            if session != "B":
                body["session_id"] = session
            cached[session] = post_json(f"{url}/generate", body)["meta_info"]["cached_tokens"]
        stats = get_json(f"{url}/vamp/stats")
        with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
            stats["metrics_text"] = response.read().decode()
        stats["by_rank"] = {name: [_metric(url, name, rank) for rank in range(tp_size)]
                            for name in ("vamp:radix_open_session_tokens", "vamp:radix_cached_tokens",
                                         "vamp:radix_evictable_tokens")}
    stats["decision_logs"] = [decision_log] + [Path(f"{decision_log}.rank{rank}") for rank in range(1, tp_size)]
    print(f"second turns cached {cached} of {TURN_TOKENS + NEW_TOKENS} tokens; one-shot cached "
          f"{one_shot['meta_info']['cached_tokens']}; evicted {stats['radix']['evicted_tokens']} tokens")
    return cached, stats


def test_the_closed_session_is_evicted_first(second_turns):
    cached, stats = second_turns
    assert stats["radix"]["evicted_tokens"] > 0, "the one-shot prompt did not cause an eviction"
    # the last output token is not in the tree (SGLang caches up to the last token it computed KV for)
    assert cached["A"] >= TURN_TOKENS + NEW_TOKENS - 1, cached
    assert cached["C"] >= TURN_TOKENS + NEW_TOKENS - 1, cached
    assert cached["B"] < TURN_TOKENS, cached


def test_the_decision_saw_the_shortfall_and_evicted(second_turns):
    _, stats = second_turns
    assert stats["decisions"]["evict"] >= 1, stats["decisions"]
    assert stats["decision_errors"] == 0


def test_stats_report_what_open_sessions_hold(second_turns):
    """A's and C's two turns are tagged and open; B's KV was closed and then resent without a session."""
    _, stats = second_turns
    radix = stats["radix"]
    assert radix["tree_core"] == "python"  # SGLang's Rust core has no sessions: auto extends its Python core
    assert 2 * (TURN_TOKENS + NEW_TOKENS) <= radix["open_session_tokens"] < radix["cached_tokens"], radix
    assert "vamp:radix_open_session_tokens{" in stats["metrics_text"]


def test_ranks_keep_the_same_sessions_kv_and_decide_alike(second_turns):
    """Each TP rank tags, closes and evicts in its own tree: equal per-rank figures and equal decision logs
    (snapshots hold each rank's candidates in its eviction order) show the ranks took the same KV."""
    _, stats = second_turns
    for name, values in stats["by_rank"].items():
        assert values[0] is not None and all(v == values[0] for v in values), (name, values)
    logs = [[json.loads(line) for line in path.read_text().splitlines()] for path in stats["decision_logs"]]
    assert logs[0], "no decision was logged"

    def strip(log):
        return [(d["step"], d["site"], d.get("snapshot"), d["plan"], d["outcome"]) for d in log]

    assert all(strip(log) == strip(logs[0]) for log in logs[1:])
