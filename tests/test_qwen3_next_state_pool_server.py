"""VAMP-20 grows the tiny Qwen3-Next's linear-attention state pool from expert memory, through our launcher on CPU.

One server: a full-attention pool large enough for the whole load, but a state pool of STATE_SLOTS slots
while SESSIONS closed-loop sessions run at once. Each running request holds a slot and every finished
turn leaves a state checkpoint for its session's next turn, so the start pool cannot keep them all. With
the state pool grown from expert pages at its shortfalls:
- state shortfalls happened (the start pool was short) and offloads covered them: the state pool is
  past its start size, and its groups are counted apart from the KV pool's (which did not grow);
- until some turn has reused a prefix, Eq. 1 prices a checkpoint at 0 and the shortfalls evict; then
  offloading wins, and no state allocation falls short afterwards: the last turn of every session
  resumes from the checkpoint its previous turn left (cached tokens = the whole previous context but
  its last token);
- the greedy tokens of every turn equal `vamp_sglang.tiny_next_reference`;
- idle, the experts come back: the states the start pool cannot hold are evicted, the rest moved below
  it, and every session's next request (on the start pool, resuming from a moved state or from scratch)
  still equals the reference.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, get_json, post_json
from tests.test_qwen3_next_vamp_server import GREEDY, NEW_TOKENS, _session
from tests.test_server_decisions import _metric
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint
from vamp_sglang.tiny_next_reference import TinyNextReference

pytestmark = pytest.mark.server
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-next"
POOL_TOKENS, STATE_SLOTS, SESSIONS = 4096, 6, 4
IDLE_WAIT_S = 60  # the experts come back after 10 s idle


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = make_checkpoint(MODEL, arch="qwen3_next")
    logs = tmp_path_factory.mktemp("logs")
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, log_dir=str(logs),
                        extra_flags=("--max-mamba-cache-size", str(STATE_SLOTS)))
    flags = ("--vamp-max-offload-ratio", "0.2", "--vamp-decision-log", str(logs / "decisions.jsonl"))
    with Server(setup, ServerConfig("qwen3-next-state-pool", flags)) as server:
        before = get_json(f"{server.url}/vamp/stats")
        with cf.ThreadPoolExecutor(SESSIONS) as pool:
            sessions = list(pool.map(lambda s: _session(server.url, s), range(SESSIONS)))
        after = get_json(f"{server.url}/vamp/stats")
        slots_metric = _metric(server.url, "vamp:state_pool_slots", 0)
        deadline, restored = time.monotonic() + IDLE_WAIT_S, after
        while restored["experts"]["offloaded_groups"] and time.monotonic() < deadline:
            time.sleep(2)
            restored = get_json(f"{server.url}/vamp/stats")
        # every session once more, on the smaller pool: its cached prefix resumes from a moved state
        again = [post_json(f"{server.url}/generate", {"input_ids": s["context"], "sampling_params": GREEDY})
                 for s in sessions]
        return {"model": model, "sessions": sessions, "before": before, "log": logs / "decisions.jsonl",
                "after": after, "slots_metric": slots_metric, "restored": restored, "again": again}


def test_state_shortfalls_grew_the_state_pool_from_experts(run):
    before, after = run["before"]["state_pool"], run["after"]["state_pool"]
    assert before["slots"] == before["baseline_slots"] == STATE_SLOTS
    assert after["shortfalls"] > 0 and after["decisions"].get("offload", 0) + after["decisions"].get("combined", 0) > 0
    assert after["slots"] > STATE_SLOTS and after["slots_added"] == after["slots"] - STATE_SLOTS
    assert after["groups"] == run["after"]["experts"]["offloaded_groups"] > 0
    assert run["after"]["kv_pool"]["tokens"] == POOL_TOKENS and run["after"]["kv_pool"]["groups"] == 0
    assert after["decision_errors"] == 0 and after["grows_from_experts"] is True
    assert run["slots_metric"] == after["slots"]  # the vamp:state_pool_slots series says the same


def test_eviction_until_reuse_is_seen_then_offload_and_no_shortfall_after(run):
    """Eq. 1 prices a state by observed reuse: while no turn has hit yet a state costs 0 to drop, so the
    first shortfalls evict; once turns resume from checkpoints, offloading is cheaper, and after the
    state pool grew no state allocation fell short again."""
    log = [json.loads(line) for line in run["log"].read_text().splitlines()]
    load = log[:next((i for i, d in enumerate(log) if d["site"] == "restore"), len(log))]  # before the idle restore
    state = [d for d in load if d["site"] == "state"]
    first_offload = next(i for i, d in enumerate(state) if d["outcome"]["slots_added"] > 0)
    assert all(d["plan"]["action"] == "evict" for d in state[:first_offload])
    assert state[first_offload]["snapshot"]["observed_hit_rate"] > 0
    assert first_offload == len(state) - 1
    for session in run["sessions"]:  # the last turn of every session came after the growth
        prev, last = session["turns"][-2:]
        assert last["cached_tokens"] == prev["prompt_tokens"] + NEW_TOKENS - 1


def test_greedy_tokens_equal_the_plain_torch_reference(run):
    reference = TinyNextReference(run["model"])
    for session in run["sessions"]:
        predicted = reference.logits(session["context"][:-1]).argmax(-1).tolist()
        for turn in session["turns"]:
            start = turn["prompt_tokens"]
            assert turn["output_ids"] == predicted[start - 1:start - 1 + NEW_TOKENS]


def test_idle_restore_shrinks_the_state_pool_back_and_moved_states_still_resume_right(run):
    restored = run["restored"]
    assert restored["experts"]["offloaded_groups"] == 0 and restored["decisions"]["restore"] >= 1
    state = restored["state_pool"]
    assert (state["slots"], state["groups"]) == (STATE_SLOTS, 0)
    assert 0 < state["cached_states"] <= STATE_SLOTS
    reference = TinyNextReference(run["model"])
    resumed = 0
    for session, out in zip(run["sessions"], run["again"]):
        ids = session["context"] + out["output_ids"]
        predicted = reference.logits(ids[:-1]).argmax(-1).tolist()
        assert out["output_ids"] == predicted[len(session["context"]) - 1:]
        resumed += out["meta_info"]["cached_tokens"] > 0
    assert resumed > 0  # at least one resumed from a cached state that survived the shrink
