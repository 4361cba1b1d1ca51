"""Through the real CPU server with HiCache (issue 22): a prefix pushed out of the device pool comes back from
the host pool (`meta_info.cached_tokens_details.host`), with the same greedy text as its first run, HiCache alone
and with VAMP on.

One module, servers started one after another (under /tmp/vamp-server.lock), each on a 1024-token start-up
device pool with the `direct` io backend, write-through and write-back. Every server gets prompt A, then B and C
(together longer than the device pool, so A's or B's device copy is evicted; all three fit the host pool), then
A and B again. Which of the two loses its device copy is the eviction order's choice (SGLang's LRU takes A, VAMP's
order the newest, B, by its tie rule or by farthest expected use): the one that does must come back from host.
- HiCache alone (VAMP off): 450-token prompts, `--hicache-ratio 2` (2048 host tokens).
- VAMP + HiCache: one expert group of the tiny model's 16 offloaded at start (`--vamp-initial-offload-ratio`
  equal to the maximum, so no headroom is left): the pool grows to 5120 tokens, and 2000-token prompts need an
  eviction decision at C; `--hicache-ratio 8` (8192 host tokens). The decision log records which candidates
  had a host copy (all of them under write-through, whose copies exist before the eviction).
- VAMP + HiCache at TP 2: one group of a rank's 64 experts (ratio 0.125) grows the pool to 9216 tokens, so
  3500-token prompts with `--hicache-ratio 12`; both ranks log the same decisions, with the same host copies and
  the same agreed load rate although each measured its own.
"""

import dataclasses
import json
import random
import time
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"
POOL_TOKENS, NEW_TOKENS = 1024, 8
HICACHE = ("--enable-hierarchical-cache", "--hicache-io-backend", "direct")
WRITE_BACK = ("--hicache-write-policy", "write_back")
VAMP = ("--vamp-max-offload-ratio", "0.0625", "--vamp-initial-offload-ratio", "0.0625",
        "--vamp-restore-after-steps", "0")
OFF = ("--vamp-max-offload-ratio", "0")
VAMP_TP2 = ("--vamp-max-offload-ratio", "0.125", "--vamp-initial-offload-ratio", "0.125",
            "--vamp-restore-after-steps", "0")
RUNS = {  # name -> (flags, prompt tokens, TP size)
    "hicache": ((*OFF, *HICACHE, "--hicache-ratio", "2"), 450, 1),
    "hicache-wb": ((*OFF, *HICACHE, "--hicache-ratio", "2", *WRITE_BACK), 450, 1),
    "vamp-hicache": ((*VAMP, *HICACHE, "--hicache-ratio", "8"), 2000, 1),
    "vamp-hicache-wb": ((*VAMP, *HICACHE, "--hicache-ratio", "8", *WRITE_BACK), 2000, 1),
    "vamp-hicache-tp2": ((*VAMP_TP2, *HICACHE, "--hicache-ratio", "12"), 3500, 2),
}
VAMP_RUNS = ["vamp-hicache", "vamp-hicache-wb", "vamp-hicache-tp2"]


def _prompts(vocab_size, tokens):
    rng = random.Random(22)
    firsts = rng.sample(range(10, vocab_size), 3)
    return [[first] + [rng.randrange(10, vocab_size) for _ in range(tokens - 1)] for first in firsts]


def _grown(server):
    """At TP 2 the start-up offload waits for the ranks' first agreement rounds: tiny requests until it is in."""
    for _ in range(60):
        if get_json(f"{server.url}/vamp/stats")["kv_pool"]["tokens"] > POOL_TOKENS:
            return
        post_json(f"{server.url}/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
        time.sleep(1)


def _serve(setup, name, vocab_size, log_dir):
    flags, tokens, tp = RUNS[name]
    setup = dataclasses.replace(setup, tp_size=tp)
    log = log_dir / f"{name}.jsonl"
    if name in VAMP_RUNS:
        flags = (*flags, "--vamp-decision-log", str(log))
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    a, b, c = _prompts(vocab_size, tokens)
    with Server(setup, ServerConfig(name, flags)) as server:
        if name in VAMP_RUNS:
            _grown(server)
        out = [post_json(f"{server.url}/generate", {"input_ids": p, "sampling_params": greedy})
               for p in (a, b, c, a, b)]
        stats = get_json(f"{server.url}/vamp/stats")
    records = _records(log)
    return ([(r["output_ids"], r["meta_info"].get("cached_tokens", 0), r["meta_info"].get("cached_tokens_details"))
             for r in out], stats, records)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = ensure_tiny_model(MODEL)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    log_dir = tmp_path_factory.mktemp("logs")
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, log_dir=str(log_dir),
                        extra_flags=("--enable-cache-report",))
    runs = {name: _serve(setup, name, vocab_size, log_dir) for name in RUNS}
    runs["tp2-rank1"] = _records(log_dir / "vamp-hicache-tp2.jsonl.rank1")
    return runs


@pytest.mark.parametrize("name", list(RUNS))
def test_prefix_pushed_out_of_the_device_pool_comes_back_from_host(runs, name):
    (first_a, first_b, _, again_a, again_b), stats, _ = runs[name]
    tokens = RUNS[name][1]
    assert first_a[1] == 0
    first, again = max([(first_a, again_a), (first_b, again_b)], key=lambda pair: (pair[1][2] or {}).get("host", 0))
    details = again[2] or {}
    assert details.get("host", 0) >= tokens - 64, f"{name}: {again[1]} cached, details {details}"
    assert again[0] == first[0], f"{name}: greedy text changed after the host load"
    tier = stats["hicache"]
    assert tier["host_hit_tokens"] >= details["host"] and tier["load_us_per_token"] > 0
    assert tier["host_pool_bytes"] > 0


@pytest.mark.parametrize("name", VAMP_RUNS)
def test_vamp_grew_the_pool_evicted_and_reports_both_host_sizes(runs, name):
    _, stats, records = runs[name]
    assert stats["kv_pool"]["tokens"] > POOL_TOKENS and stats["experts"]["offloaded_groups"] == 1
    assert stats["hicache"]["expert_host_bytes"] > 0
    assert stats["decisions"]["evict"] >= 1
    snapshots = [r["snapshot"] for r in records if r.get("snapshot", {}).get("evictable")]
    assert snapshots and all(s.get("host_load_us_per_token", 0) > 0 for s in snapshots)


def test_write_through_candidates_have_host_copies_write_back_ones_not_yet(runs):
    def copies(name):
        return [e.get("host_copy", False) for r in runs[name][2] for e in r.get("snapshot", {}).get("evictable", [])]

    assert copies("vamp-hicache") and all(copies("vamp-hicache"))
    assert copies("vamp-hicache-wb") and not any(copies("vamp-hicache-wb"))


def test_both_tp2_ranks_decide_alike_with_the_same_host_copies_and_load_rate(runs):
    rank0, rank1 = runs["vamp-hicache-tp2"][2], runs["tp2-rank1"]
    assert rank0 and [r["snapshot"] for r in rank0] == [r["snapshot"] for r in rank1]
    assert [r["plan"] for r in rank0] == [r["plan"] for r in rank1]
    assert any(e.get("host_copy") for r in rank0 for e in r["snapshot"]["evictable"])
