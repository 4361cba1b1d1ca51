"""VAMP-50 with Qwen3-Next's MTP draft (`--speculative-algorithm NEXTN`, 3 steps, top-k 1, 4 draft tokens) on
CPU: the state pool, the KV pool and the draft's KV pool grow from expert memory under speculation (make
test-long, lane of the caller's VAMP_SERVER_LOCK).

One server on the tiny Qwen3-Next with a draft built to agree (`write_agreeing_draft`: most drafts are accepted,
some partly, so the verify's per-draft-token states decide what each linear-attention layer keeps), a state
pool of STATE_SLOTS slots and a KV pool of POOL_TOKENS while SESSIONS closed-loop sessions run at once (at
ratio 0.2 the state pool's first shortfalls took the whole bound, 3 groups, and the KV shortfalls evicted;
0.5 leaves groups for both):
- the state pool grew past its start size (its per-draft-token buffers are one row per running request, so
  they need no growth: integration/memory/state_pool.py), and so did the KV pool and, by the same count, the
  draft's KV pool (its HybridLinearKVPool wrapper mirrors the size);
- the drafts were accepted (SGLang's mean accept length well above 1);
- every turn's greedy tokens equal `vamp_sglang.tiny_next_reference`, which are ratio 0's without speculation
  (tests/test_qwen3_next_state_pool_server.py checks the reference against a server; on this checkpoint a
  ratio-0 server without speculation gave the same tokens on 2026-12-07).
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, get_json
from tests.test_qwen3_next_state_pool_server import (
    test_greedy_tokens_equal_the_plain_torch_reference as tokens_equal_the_reference,
)
from tests.test_qwen3_next_vamp_server import FIRST_TOKENS, GROWTH_TOKENS, NEW_TOKENS, TURNS, _session
from tests.test_speculative_cpu_server import CHAIN
from vamp_sglang.tiny_moe.agreeing_draft import write_agreeing_draft
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.long]
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-next"
SESSIONS, STATE_SLOTS = 4, 6
# Final context FIRST + 5 * (GROWTH + NEW) + NEW = 384 tokens a session; four need 1,536 of the pool's 512.
POOL_TOKENS = 512
assert SESSIONS * (FIRST_TOKENS + (TURNS - 1) * (GROWTH_TOKENS + NEW_TOKENS) + NEW_TOKENS) > POOL_TOKENS


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = write_agreeing_draft(make_checkpoint(MODEL, arch="qwen3_next"),
                                 tmp_path_factory.mktemp("agree") / "next")
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS,
                        extra_flags=("--max-mamba-cache-size", str(STATE_SLOTS)))
    flags = ("--vamp-max-offload-ratio", "0.5", "--speculative-algorithm", "NEXTN", *CHAIN)
    with Server(setup, ServerConfig("qwen3-next-nextn-vamp-50", flags)) as server:
        before = get_json(f"{server.url}/vamp/stats")
        with cf.ThreadPoolExecutor(SESSIONS) as pool:
            sessions = list(pool.map(lambda s: _session(server.url, s), range(SESSIONS)))
        return {"model": model, "sessions": sessions, "before": before, "after": get_json(f"{server.url}/vamp/stats")}


def test_state_kv_and_draft_pools_grew_under_speculation(run):
    before, after = run["before"], run["after"]
    assert before["state_pool"]["slots"] == STATE_SLOTS and before["kv_pool"]["tokens"] == POOL_TOKENS
    state = after["state_pool"]
    assert state["slots"] > STATE_SLOTS and state["groups"] > 0 and state["decision_errors"] == 0
    assert after["kv_pool"]["tokens"] > POOL_TOKENS and after["kv_pool"]["groups"] > 0
    assert [d["tokens"] for d in after["draft_pools"]] == [after["kv_pool"]["tokens"]]
    print("state slots", STATE_SLOTS, "->", state["slots"], "kv", POOL_TOKENS, "->", after["kv_pool"]["tokens"],
          "accept length", after["speculation"]["accept_length"])


def test_drafts_were_accepted(run):
    speculation = run["after"]["speculation"]
    assert speculation["algorithm"] == "EAGLE" and speculation["verify_steps"] > 0
    assert speculation["accept_length"] > 2.0  # of 4 at most: later chain positions and partial accepts ran


def test_greedy_tokens_equal_ratio_0_without_speculation(run):
    tokens_equal_the_reference(run)
