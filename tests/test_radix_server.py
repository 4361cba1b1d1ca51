"""Through real CPU servers: our tree keeps multi-turn session prefixes that stock LRU evicts.

One module, two servers started one after the other (under /tmp/vamp-server.lock), both with VAMP's
offloading off (`--vamp-max-offload-ratio 0`) and the same small pool: ours
(`--radix-cache-backend vamp --radix-eviction-policy vamp`), then stock SGLang (its default tree,
LRU). Both get the same sequential workload: a few multi-turn sessions (each turn resends the whole
conversation plus a new message) start alone for two rounds, then a stream of one-shot prompts
arrives that alone overflows the pool between two turns of a session. A prefix is worth keeping
only once it has been reused, so the sessions need those two quiet rounds to show their value; the
hit rates compared are those of the session turns under pressure. They are read from what the
scheduler reports per request (`meta_info.cached_tokens`), the same statistic for both servers.
"""

import json
import random
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (two servers)
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"
POOL_TOKENS = 1536
SESSIONS, QUIET_ROUNDS, ROUNDS = 3, 2, 6
FIRST_TURN_TOKENS, TURN_TOKENS, NEW_TOKENS = 96, 24, 8
ONE_SHOTS_PER_ROUND, ONE_SHOT_TOKENS = 8, 200  # 1,664 tokens per round against a 1,536-token pool
CONFIGS = {
    "vamp": ("--vamp-max-offload-ratio", "0", "--radix-cache-backend", "vamp", "--radix-eviction-policy", "vamp"),
    "stock": ("--vamp-max-offload-ratio", "0"),
}




def _run_workload(url: str, vocab_size: int) -> dict:
    """Rounds of: one turn of every session, then (after the quiet rounds) the one-shot prompts."""
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(10, vocab_size) for _ in range(n)]  # ids below 10 are special tokens
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    before = get_json(f"{url}/vamp/stats")
    histories = [draw(FIRST_TURN_TOKENS) for _ in range(SESSIONS)]
    turns, one_shots = [], []
    for round_index in range(ROUNDS):
        for s in range(SESSIONS):
            out = post_json(f"{url}/generate", {"input_ids": histories[s], "sampling_params": greedy})
            turns.append((round_index, out["meta_info"]))
            histories[s] = histories[s] + out["output_ids"] + draw(TURN_TOKENS)
        for _ in range(ONE_SHOTS_PER_ROUND if round_index >= QUIET_ROUNDS else 0):
            out = post_json(f"{url}/generate", {"input_ids": draw(ONE_SHOT_TOKENS), "sampling_params": greedy})
            one_shots.append(out["meta_info"])
    pressed = [m for r, m in turns if r >= QUIET_ROUNDS]
    return {
        "session_hit_rate": sum(m["cached_tokens"] for m in pressed) / sum(m["prompt_tokens"] for m in pressed),
        "quiet_hit_rate": sum(m["cached_tokens"] for r, m in turns if 0 < r < QUIET_ROUNDS)
        / sum(m["prompt_tokens"] for r, m in turns if 0 < r < QUIET_ROUNDS),
        "one_shot_hit_rate": sum(m["cached_tokens"] for m in one_shots) / sum(m["prompt_tokens"] for m in one_shots),
        "stats_before": before,
        "stats": get_json(f"{url}/vamp/stats"),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model = ensure_tiny_model(MODEL)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, log_dir=str(tmp_path_factory.mktemp("logs")))
    out = {}
    for name, flags in CONFIGS.items():
        with Server(setup, ServerConfig(name, flags)) as server:
            out[name] = _run_workload(server.url, vocab_size)
    for name, r in out.items():
        print(f"{name}: session turns under pressure {r['session_hit_rate']:.3f}, quiet turns "
              f"{r['quiet_hit_rate']:.3f}, one-shots {r['one_shot_hit_rate']:.3f}")
    return out


def test_our_tree_keeps_session_prefixes_that_lru_evicts(results):
    ours, stock = results["vamp"]["session_hit_rate"], results["stock"]["session_hit_rate"]
    # a later turn resends ~(history + 8 output + 24 new) tokens; all but the new ones can hit
    assert ours > 0.7, f"our tree lost session prefixes (hit rate {ours:.3f})"
    assert stock < 0.3, f"stock LRU kept session prefixes (hit rate {stock:.3f}): workload too gentle"
    assert ours - stock > 0.4


def test_both_servers_serve_quiet_turns_from_cache_and_one_shots_never(results):
    for name in CONFIGS:
        assert results[name]["quiet_hit_rate"] > 0.7, name
        assert results[name]["one_shot_hit_rate"] < 0.02, name


def test_our_radix_stats_show_the_pressure_and_the_reuse(results):
    radix = results["vamp"]["stats"]["radix"]
    assert radix["tree_core"] == "rust"  # --vamp-tree-core auto: VAMP's order beside SGLang's Rust core
    assert "mirror_lost" not in radix  # the mirror followed the real scheduler throughout (its count checked per eviction)
    assert radix["evicted_tokens"] > ONE_SHOTS_PER_ROUND * ONE_SHOT_TOKENS  # the pool really overflowed
    assert radix["cached_tokens"] <= POOL_TOKENS
    admitted = radix["admissions"] - results["vamp"]["stats_before"]["radix"]["admissions"]  # less warm-up
    assert admitted == ROUNDS * SESSIONS + (ROUNDS - QUIET_ROUNDS) * ONE_SHOTS_PER_ROUND
    assert sum(radix["hits_histogram"].values()) == radix["node_count"]
    assert sum(count for label, count in radix["hits_histogram"].items() if label not in ("0", "1")) > 0
    assert 0.0 < radix["hit_rate"] < 1.0
    assert "hits_histogram" not in results["stock"]["stats"]["radix"]  # stock tree: sizes only
