"""VAMP on the tiny Qwen3.5 MoE (`tiny_moe --arch qwen3_5_moe`), through our launcher on CPU (issue 47).

Two servers, one at a time, on the same multi-turn requests (the sessions of tests/test_deepseek_vamp_server.py:
3 at once, 6 turns of 8 greedy tokens, 384 tokens each at the end): ratio 0 on pools large enough that nothing is
evicted (the reference run), then VAMP-20 on a full-attention pool of POOL_TOKENS, which the three final
contexts exceed more than twice, and a linear-attention state pool of STATE_SLOTS slots, which three running
requests and the checkpoints their turns leave outgrow. VAMP-20 bounds the offload at 3 of the 16 groups per
layer; it offloads one group per step (`--vamp-expand-groups 1`), else the first shortfall (here a state one)
takes all three and the other pool has none left to grow from. Checked:
- the reference run's greedy tokens equal transformers' Qwen3_5MoeForCausalLM (one teacher-forced forward over
  each session's final context: each turn's tokens are the argmax at the positions before them);
- VAMP-20 grew both pools from expert memory: an offload decided at a KV shortfall and one at a state
  shortfall, the KV pool and the state pool each past its start size, with groups counted in each;
- VAMP-20's greedy tokens equal the reference run's.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, get_json
from tests.test_deepseek_vamp_server import POOL_TOKENS, SESSIONS, _session
from tests.test_new_families_server import test_reference_run_equals_transformers as _equals_transformers
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (two servers)
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-5-moe"
STATE_SLOTS = 6
RUNS = {"ratio0-large": ("0", 8192, None), "vamp20": ("0.2", POOL_TOKENS, STATE_SLOTS)}  # ratio, tokens, slots


def _serve(model: Path, logs: Path, name: str) -> dict:
    ratio, pool, slots = RUNS[name]
    extra = ("--max-mamba-cache-size", str(slots)) if slots else ()
    setup = ServerSetup(str(model), max_total_tokens=pool, log_dir=str(logs), extra_flags=extra)
    log = logs / f"decisions-{name}.jsonl"
    vamp = ("--vamp-expand-groups", "1", "--vamp-decision-log", str(log)) if ratio != "0" else ()
    flags = ("--vamp-max-offload-ratio", ratio, *vamp)
    with Server(setup, ServerConfig(f"qwen3-5-moe-{name}", flags)) as server:
        before = get_json(f"{server.url}/vamp/stats")
        with cf.ThreadPoolExecutor(SESSIONS) as workers:
            sessions = list(workers.map(lambda s: _session(server.url, s), range(SESSIONS)))
        return {"sessions": sessions, "before": before, "after": get_json(f"{server.url}/vamp/stats"),
                "log": log}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = make_checkpoint(MODEL, arch="qwen3_5_moe")
    logs = tmp_path_factory.mktemp("logs")
    return {"model": model} | {name: _serve(model, logs, name) for name in RUNS}


def test_reference_run_equals_transformers(runs):
    import transformers

    assert transformers.AutoConfig.from_pretrained(runs["model"]).architectures == ["Qwen3_5MoeForCausalLM"]
    _equals_transformers(runs)


def test_vamp20_grew_both_pools_from_expert_memory(runs):
    before, after = runs["vamp20"]["before"], runs["vamp20"]["after"]
    assert before["kv_pool"]["tokens"] == before["kv_pool"]["baseline_tokens"] == POOL_TOKENS
    assert before["state_pool"]["slots"] == before["state_pool"]["baseline_slots"] == STATE_SLOTS
    assert after["kv_pool"]["tokens"] > POOL_TOKENS and after["kv_pool"]["groups"] >= 1
    assert after["state_pool"]["slots"] > STATE_SLOTS and after["state_pool"]["groups"] >= 1
    decisions = [json.loads(line) for line in runs["vamp20"]["log"].read_text().splitlines()]
    at_state_shortfall = {d["site"] == "state" for d in decisions
                          if d.get("plan", {}).get("action") in ("offload", "combined")}
    assert at_state_shortfall == {True, False}  # offloads at both a KV and a state shortfall


def test_vamp20_greedy_outputs_equal_the_reference_run(runs):
    assert [s["context"] for s in runs["vamp20"]["sessions"]] == [
        s["context"] for s in runs["ratio0-large"]["sessions"]]
