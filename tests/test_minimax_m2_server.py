"""VAMP on the tiny MiniMax-M2 (`tiny_moe --arch minimax_m2`), through our launcher on CPU (issue 47).

The checks of tests/test_new_families_server.py on this family, plus attention TP 2, three servers one at a
time on the same multi-turn requests: ratio 0 on a pool large enough that nothing is evicted (the reference
run), then VAMP-20 on a pool of POOL_TOKENS at TP 1 and at TP 2. Checked:
- the reference run's greedy tokens equal transformers' MiniMaxM2ForCausalLM (one teacher-forced forward
  over each session's final context), which exercises SGLang's whole-vector QK norm (answered in torch on
  CPU, vamp_sglang/cpu/triton_free.py), its half-rotary RoPE and its biased sigmoid routing;
- VAMP-20 grew the KV pool from expert memory, and its greedy tokens equal the reference run's; at TP 2 too,
  where each rank holds half the heads and the QK norm's variance is all-reduced over both.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, get_json
from tests.test_deepseek_vamp_server import POOL_TOKENS, SESSIONS, _session
from tests.test_new_families_server import test_reference_run_equals_transformers as _equals_transformers
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (three servers)
ARCH = "minimax_m2"
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-minimax-m2"
RUNS = {"ratio0-large": ("0", 1, 8192), "vamp20": ("0.2", 1, POOL_TOKENS),  # name -> (ratio, tp, pool)
        "vamp20-tp2": ("0.2", 2, POOL_TOKENS)}
VAMP_RUNS = ["vamp20", "vamp20-tp2"]


def _serve(model: Path, name: str) -> dict:
    ratio, tp, pool = RUNS[name]
    setup = ServerSetup(str(model), max_total_tokens=pool, tp_size=tp)
    with Server(setup, ServerConfig(f"{ARCH}-{name}", ("--vamp-max-offload-ratio", ratio))) as server:
        before = get_json(f"{server.url}/vamp/stats")
        with cf.ThreadPoolExecutor(SESSIONS) as workers:
            sessions = list(workers.map(lambda s: _session(server.url, s), range(SESSIONS)))
        return {"sessions": sessions, "before": before, "after": get_json(f"{server.url}/vamp/stats")}


@pytest.fixture(scope="module")
def runs():
    model = make_checkpoint(MODEL, arch=ARCH)
    return {"arch": ARCH, "model": model} | {name: _serve(model, name) for name in RUNS}


def test_reference_run_equals_transformers(runs):
    import transformers

    assert transformers.AutoConfig.from_pretrained(runs["model"]).architectures == ["MiniMaxM2ForCausalLM"]
    _equals_transformers(runs)


@pytest.mark.parametrize("name", VAMP_RUNS)
def test_vamp20_grew_the_pool_from_expert_memory(runs, name):
    before, after = runs[name]["before"], runs[name]["after"]
    assert before["kv_pool"]["tokens"] == before["kv_pool"]["baseline_tokens"] == POOL_TOKENS
    assert after["kv_pool"]["tokens"] > POOL_TOKENS and after["decisions"]["offload"] >= 1


@pytest.mark.parametrize("name", VAMP_RUNS)
def test_vamp20_greedy_outputs_equal_the_reference_run(runs, name):
    assert [s["context"] for s in runs[name]["sessions"]] == [s["context"] for s in runs["ratio0-large"]["sessions"]]
