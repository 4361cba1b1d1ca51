"""FP8 experts through real CPU servers (issue 20): the tiny block-FP8 Qwen3-MoE, served by SGLang's FP8
methods, pages, stages and restores its FP8 experts with greedy output unchanged.

Servers one after another get the same sequential multi-turn workload (one request at a time, so the
schedule is the same in every run; sessions' contexts grow past the pool): the FP8 model at ratio 0 on a
pool that holds everything (the reference), its bf16 source on the same pool (the exact dequantisation:
same tokens), VAMP-20 on a small pool under `--vamp-staging whole` and `routed`, and VAMP-20 at TP 2
under the default `auto`, whose ranks must log the same decisions. VAMP's runs grow the pool from FP8
expert pages at their shortfalls, so they evict nothing either and their tokens must equal the
reference's. TP 2 is compared with the FP8 model at ratio 0 at TP 2: bf16 sums split over two ranks round
differently from one rank's, so TP 1 and TP 2 need not give the same tokens (they differed at the fourth
request here). A checkpoint whose FP8 layout VAMP cannot page is refused before the first request.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerError, ServerSetup, get_json, post_json
from vamp_sglang.tiny_moe import fp8

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (several servers)

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe-fp8-test"  # not `make model QUANT=fp8`'s
MODEL_FLAGS = ("--quant", "fp8", "--layers", "4", "--experts", "80", "--kv-heads", "4")  # 2 groups of 8 at
# VAMP-20 (1 of 16 at TP 2); 4 KV heads so that each rank's K and V projections are whole 128-row blocks at TP 2
BIG_POOL, SMALL_POOL = 8192, 1024
SESSIONS, TURNS, FIRST_TOKENS, GROWTH_TOKENS, NEW_TOKENS = 3, 5, 200, 96, 12
VAMP20 = ("--vamp-max-offload-ratio", "0.2", "--vamp-restore-after-steps", "0")


def ensure_fp8_model() -> Path:
    """Written once; the CLI reuses a checkpoint whose manifest records the same spec (a second or so)."""
    subprocess.run([sys.executable, "-m", "vamp_sglang.tiny_moe", str(MODEL), *MODEL_FLAGS], check=True)
    return MODEL


def _sessions(url):
    """The sessions one after another, each turn extending the last prompt and its answer."""
    answers, cached = [], 0
    for seed in range(SESSIONS):
        rng, ids = random.Random(seed), []
        for _ in range(TURNS):
            ids += [rng.randrange(10, 2000) for _ in range(FIRST_TOKENS if not ids else GROWTH_TOKENS)]
            out = post_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
            answers.append(out["output_ids"])
            cached += out["meta_info"]["cached_tokens"]
            ids = ids + out["output_ids"]
    return answers, cached


def _serve(logs, name, model, pool, flags=(), tp_size=1):
    setup = ServerSetup(str(model), max_total_tokens=pool, tp_size=tp_size, log_dir=str(logs))
    with Server(setup, ServerConfig(name, tuple(flags))) as server:
        before = get_json(f"{server.url}/vamp/stats")
        answers, cached = _sessions(server.url)
        return {"answers": answers, "cached": cached, "before": before, "after": get_json(f"{server.url}/vamp/stats")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = ensure_fp8_model()
    logs = tmp_path_factory.mktemp("logs")
    tp2_log = logs / "tp2.jsonl"
    return {
        "reference": _serve(logs, "fp8-ratio0", model, BIG_POOL, ("--vamp-max-offload-ratio", "0")),
        "bf16": _serve(logs, "bf16-source", model / fp8.SOURCE_DIR, BIG_POOL,
                       ("--vamp-max-offload-ratio", "0", "--dtype", "bfloat16")),
        "whole": _serve(logs, "fp8-vamp20-whole", model, SMALL_POOL, (*VAMP20, "--vamp-staging", "whole")),
        "routed": _serve(logs, "fp8-vamp20-routed", model, SMALL_POOL, (*VAMP20, "--vamp-staging", "routed")),
        "reference_tp2": _serve(logs, "fp8-ratio0-tp2", model, BIG_POOL, ("--vamp-max-offload-ratio", "0"),
                                tp_size=2),
        "tp2": _serve(logs, "fp8-vamp20-tp2", model, SMALL_POOL, (*VAMP20, "--vamp-decision-log", str(tp2_log)),
                      tp_size=2),
        "tp2_logs": (tp2_log, Path(f"{tp2_log}.rank1")),
        "logs": logs,
    }


def test_the_fp8_model_gives_its_bf16_sources_tokens(runs):
    reference = runs["reference"]
    assert len(reference["answers"]) == SESSIONS * TURNS and reference["cached"] > 0
    assert runs["bf16"]["answers"] == reference["answers"]


@pytest.mark.parametrize("name", ["whole", "routed", "tp2"])
def test_vamp20_grows_the_pool_from_fp8_experts_with_greedy_output_unchanged(runs, name):
    run = runs[name]
    assert run["answers"] == runs["reference_tp2" if name == "tp2" else "reference"]["answers"], \
        f"{name}: greedy output changed"
    before, after = run["before"], run["after"]
    assert before["experts"]["offload_ratio"] == 0.0 and before["kv_pool"]["tokens"] == SMALL_POOL
    assert after["decisions"]["offload"] >= 1 and after["experts"]["offloaded_groups"] >= 1
    assert after["kv_pool"]["tokens"] > SMALL_POOL
    assert after["radix"]["cached_tokens"] > SMALL_POOL, "no KV row above the start-up pool was used"
    staging = after["staging"]
    assert staging["bytes"] > 0 and staging["policy"] == ("auto" if name == "tp2" else name)
    row_bytes = after["experts"]["reclaimed_bytes"] // (after["experts"]["offloaded_groups"]
                                                        * after["experts"]["eligible_layers"]
                                                        * after["experts"]["shards_per_group"])
    assert row_bytes == (2 * 1024 + 1024) * 256 // (2 if name == "tp2" else 1), "an FP8 expert is 1 B/weight"
    assert staging["bytes"] % row_bytes == 0, "staged bytes are whole FP8 experts"


def test_tp2_ranks_decide_alike(runs):
    rank0, rank1 = ([json.loads(x) for x in path.read_text().splitlines()] for path in runs["tp2_logs"])
    assert rank0, "TP 2 made no decision"

    def strip(log):
        return [(d["step"], d["site"], d.get("snapshot"), d["plan"], d["outcome"]) for d in log]

    assert strip(rank0) == strip(rank1)


def test_a_quantised_layout_vamp_cannot_page_is_refused_before_the_first_request(runs, tmp_path):
    """Per-tensor FP8 (no weight_block_size): the server exits at scheduler start naming the method."""
    model = tmp_path / "per-tensor"
    model.mkdir()
    for file in MODEL.iterdir():
        if file.is_file():
            (model / file.name).symlink_to(file)
    config = json.loads((MODEL / "config.json").read_text())
    del config["quantization_config"]["weight_block_size"]
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config))
    setup = ServerSetup(str(model), max_total_tokens=SMALL_POOL, log_dir=str(runs["logs"]), startup_timeout_s=120)
    with pytest.raises(ServerError, match="per-tensor"), Server(setup, ServerConfig("per-tensor", VAMP20)):
        pass
