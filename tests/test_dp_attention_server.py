"""VAMP under DP attention, through real CPU servers: `--tp-size 2 --dp-size 2 --enable-dp-attention` on the
tiny Qwen3-MoE (float32), attention-TP 1, so each DP rank has its own pool and decides alone, with no round.

Two servers, one after the other, get the same requests: VAMP-20 on a 1,024-token pool per DP rank, and
ratio 0 on a pool so large that nothing is evicted (the reference outputs).
- Phase 1: every session goes to DP rank 0 (`routed_dp_rank`), past its pool, while one long decode runs on DP
  rank 1. Rank 0 offloads and grows, rank 1 does not, keeps decoding through rank 0's remaps (its inter-token
  gaps are printed), and no rank misses a round (there is none to miss).
- Phase 2: sessions go to DP rank 1. Its decisions see, through the MLP-sync column, that rank 0 already
  offloaded a group, so offloading one here lengthens no step: C_e is 0 in its logged snapshots.
- Phase 3: the load stops. Each DP rank, idle for IDLE_RESTORE_S, restores the group it offloaded, on its own
  (no round), and its pool returns to its start-up size.
- Both DP ranks' decision logs, `/vamp/stats`' `dp_ranks` and the `dp_rank`-labelled `vamp:*` series.
- Greedy outputs identical to the ratio-0 reference.
"""

import concurrent.futures as cf
import itertools
import json
import random
import time
import urllib.request
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"
DP = ("--dp-size", "2", "--enable-dp-attention")
SESSIONS, TURNS, FIRST_TOKENS, GROWTH_TOKENS, NEW_TOKENS = 4, 5, 256, 96, 16
LONG_DECODE_TOKENS = 160
RESTORE_WAIT_S = 120  # phase 3: IDLE_RESTORE_S (10 s) of idleness, then one restore per DP rank


def _session(url, seed, turns, dp_rank):
    rng, ids, answers = random.Random(seed), [], []
    for _ in range(turns):
        ids += [rng.randrange(10, 2000) for _ in range(FIRST_TOKENS if not ids else GROWTH_TOKENS)]
        out = post_json(f"{url}/generate", {"input_ids": ids, "routed_dp_rank": dp_rank, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
        answers.append(out["output_ids"])
        ids = ids + out["output_ids"]
    return answers


def _sessions(url, seed_base, turns, dp_rank):
    with cf.ThreadPoolExecutor(SESSIONS) as pool:
        return list(pool.map(lambda s: _session(url, seed_base + s, turns, dp_rank), range(SESSIONS)))


def _long_decode(url, dp_rank):
    """One streamed request: its output ids and the client's gap between consecutive chunks (seconds)."""
    ids = [random.Random(99).randrange(10, 2000) for _ in range(64)]
    body = {"input_ids": ids, "routed_dp_rank": dp_rank, "stream": True, "sampling_params": {
        "max_new_tokens": LONG_DECODE_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    request = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    stamps, output = [], []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                stamps.append(time.monotonic())
                output = json.loads(line[5:])["output_ids"]
    return output, [b - a for a, b in itertools.pairwise(stamps)]


def _metric(url, name, dp_rank):
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        return [float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                if line.startswith(name + "{") and f'dp_rank="{dp_rank}"' in line]


def _by_dp_rank(url):
    stats = get_json(f"{url}/vamp/stats")
    return {s["dp_rank"]: s for s in stats["dp_ranks"]}


def _serve(setup, name, flags):
    with Server(setup, ServerConfig(name, (*DP, *flags))) as server:
        url = server.url
        with cf.ThreadPoolExecutor(2) as pool:
            sessions = pool.submit(_sessions, url, 0, TURNS, 0)
            time.sleep(2)  # rank 0's first prefills are under way
            long = pool.submit(_long_decode, url, 1)
            phase1 = {"answers": sessions.result(), "long": long.result()}
        phase1["stats"] = _by_dp_rank(url)
        phase1["pool_metric"] = {r: _metric(url, "vamp:kv_pool_tokens", r) for r in (0, 1)}
        phase2 = {"answers": _sessions(url, 100, 3, 1)}
        phase2["stats"] = _by_dp_rank(url)
        return {"phase1": phase1, "phase2": phase2, "phase3": _restored(url)}


def _restored(url):
    """Phase 3: no more requests; poll until no DP rank holds an offloaded group (or RESTORE_WAIT_S)."""
    start = time.monotonic()
    while True:
        stats = _by_dp_rank(url)
        if all(s["experts"].get("offloaded_groups", 0) == 0 for s in stats.values()) \
                or time.monotonic() - start > RESTORE_WAIT_S:
            return {"stats": stats, "waited_s": time.monotonic() - start}
        time.sleep(2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = ensure_tiny_model(MODEL)
    logs = tmp_path_factory.mktemp("logs")
    log = logs / "decisions.jsonl"
    small = ServerSetup(str(model), max_total_tokens=1024, tp_size=2, log_dir=str(logs))
    large = ServerSetup(str(model), max_total_tokens=16384, tp_size=2, log_dir=str(logs))
    return {
        # calm-step restores never come within the phases (10^6 steps); idle restores do, in phase 3 only
        "vamp": _serve(small, "dp2-vamp20", ("--vamp-max-offload-ratio", "0.2",
                                             "--vamp-restore-after-steps", "1000000", "--vamp-decision-log", str(log))),
        "reference": _serve(large, "dp2-ratio0", ("--vamp-max-offload-ratio", "0")),
        "logs": [[json.loads(line) for line in path.read_text().splitlines()] for path in (log, Path(f"{log}.dp1"))],
    }


def test_only_the_dp_rank_that_is_short_offloads_and_grows(runs):
    stats = runs["vamp"]["phase1"]["stats"]
    rank0, rank1 = stats[0], stats[1]
    assert rank0["decisions"]["offload"] + rank0["decisions"]["combined"] >= 1
    assert rank0["kv_pool"]["tokens"] > rank0["kv_pool"]["baseline_tokens"]
    assert rank1["kv_pool"]["tokens"] == rank1["kv_pool"]["baseline_tokens"] == 1024
    assert sum(rank1["decisions"].values()) == 0 and rank1["experts"]["offloaded_groups"] == 0
    pools = runs["vamp"]["phase1"]["pool_metric"]
    assert pools[0] and pools[1] and max(pools[0]) > max(pools[1]) == 1024  # the dp_rank-labelled series
    for rank in (rank0, rank1):
        assert rank["failures"]["missed_rounds"] == 0 and rank["decision_errors"] == 0


def test_rank_1_keeps_decoding_through_rank_0s_remaps(runs):
    output, gaps = runs["vamp"]["phase1"]["long"]
    reference, reference_gaps = runs["reference"]["phase1"]["long"]
    assert len(output) == LONG_DECODE_TOKENS and output == reference
    gaps = sorted(gaps)
    print(f"\nDP rank 1 inter-token gaps under VAMP-20 (rank 0 remapping): median {gaps[len(gaps) // 2] * 1e3:.1f} ms, "
          f"p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.1f} ms, max {gaps[-1] * 1e3:.1f} ms; ratio 0: median "
          f"{sorted(reference_gaps)[len(reference_gaps) // 2] * 1e3:.1f} ms, max {max(reference_gaps) * 1e3:.1f} ms")


def test_each_dp_rank_writes_its_own_decision_log_and_rank_1_prices_rank_0s_offload(runs):
    rank0_log, rank1_log = runs["logs"]
    offloads0 = [e for e in rank0_log if e.get("plan", {}).get("action") in ("offload", "combined")]
    assert offloads0 and all(e["snapshot"]["dp_step"]["peer_offloaded_groups"] == 0 for e in offloads0)
    # phase 2: rank 1's shortfalls see rank 0's offloaded group in the MLP-sync column, so it is free
    assert rank1_log, "rank 1 had shortfalls in phase 2"
    peer_ahead = [e for e in rank1_log if "snapshot" in e and e["snapshot"]["dp_step"]["peer_offloaded_groups"] >= 1
                  and e["snapshot"]["dp_step"]["offloaded_groups"] == 0 and e["snapshot"]["offload"]["headroom_groups"]]
    assert peer_ahead and all(e["plan"]["costs"]["offload"] == 0.0 for e in peer_ahead)
    assert runs["vamp"]["phase2"]["stats"][1]["experts"]["offloaded_groups"] >= 1


def test_once_the_load_stops_each_dp_rank_restores_its_own_group(runs):
    """Both ranks offloaded (rank 0 in phase 1, rank 1 in phase 2); idle, each restores on its own, after its
    last offload, and both pools are back at 1,024 tokens."""
    phase3 = runs["vamp"]["phase3"]
    print(f"\nboth DP ranks restored {phase3['waited_s']:.1f} s after the last request")
    for dp_rank, log in enumerate(runs["logs"]):
        stats = phase3["stats"][dp_rank]
        assert stats["experts"]["offloaded_groups"] == 0 and stats["decisions"]["restore"] >= 1
        assert stats["kv_pool"]["tokens"] == stats["kv_pool"]["baseline_tokens"] == 1024
        restores = [i for i, e in enumerate(log) if e.get("site") == "restore"]
        offloads = [i for i, e in enumerate(log) if e.get("plan", {}).get("action") in ("offload", "combined")]
        assert restores and offloads and min(restores) > max(offloads), f"DP rank {dp_rank}: restored mid-load"
        assert all(log[i]["restore_state"]["idle"] for i in restores)
        assert sum(log[i]["outcome"]["restored_groups"] for i in restores) == max(
            runs["vamp"][phase]["stats"][dp_rank]["experts"]["offloaded_groups"] for phase in ("phase1", "phase2"))


def test_greedy_outputs_identical_to_ratio_0_on_a_pool_that_evicts_nothing(runs):
    reference = runs["reference"]
    for phase in ("phase1", "phase2"):
        assert runs["vamp"][phase]["answers"] == reference[phase]["answers"]
