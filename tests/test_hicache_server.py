"""Through the real CPU server with HiCache (issue 22): a prefix pushed out of the device pool comes back from
the host pool (`meta_info.cached_tokens_details.host`), with the same greedy text as its first run.

One module, servers started one after another (under /tmp/vamp-server.lock), each on a 1024-token device pool
with `--hicache-ratio 2` and the `direct` io backend: HiCache with write-through and with write-back at
VAMP off. Every server gets the same requests: prompt A, then B and C (together longer than the pool, so A's
device copy is evicted; all three fit the 2048-token host pool), then A again.
"""

import json
import random
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, post_json

pytestmark = [pytest.mark.server, pytest.mark.long]

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"
POOL_TOKENS, PROMPT_TOKENS, NEW_TOKENS = 1024, 450, 8
HICACHE = ("--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct")
RUNS = {
    "hicache": ("--vamp-max-offload-ratio", "0", *HICACHE),
    "hicache-wb": ("--vamp-max-offload-ratio", "0", *HICACHE, "--hicache-write-policy", "write_back"),
}


def _prompts(vocab_size):
    rng = random.Random(22)
    firsts = rng.sample(range(10, vocab_size), 3)
    return [[first] + [rng.randrange(10, vocab_size) for _ in range(PROMPT_TOKENS - 1)] for first in firsts]


def _serve(setup, name, prompts):
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    a, b, c = prompts
    with Server(setup, ServerConfig(name, RUNS[name])) as server:
        out = [post_json(f"{server.url}/generate", {"input_ids": p, "sampling_params": greedy}) for p in (a, b, c, a)]
    return [(r["output_ids"], r["meta_info"].get("cached_tokens", 0), r["meta_info"].get("cached_tokens_details"))
            for r in out]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = ensure_tiny_model(MODEL)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, log_dir=str(tmp_path_factory.mktemp("logs")),
                        extra_flags=("--enable-cache-report",))
    prompts = _prompts(vocab_size)
    return {name: _serve(setup, name, prompts) for name in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_prefix_pushed_out_of_the_device_pool_comes_back_from_host(runs, name):
    first, *_, again = runs[name]
    assert first[1] == 0
    details = again[2] or {}
    assert details.get("host", 0) >= PROMPT_TOKENS - 64, f"{name}: {again[1]} cached, details {details}"
    assert again[0] == first[0], f"{name}: greedy text changed after the host load"
