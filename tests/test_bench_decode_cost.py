"""The decode-cost bench (issue 49): its replay's byte counts against hand-computed ones, the routing order,
the JSON it writes, and a replay of a real trace checked against routed.py."""

import json
from pathlib import Path

import numpy as np
import pytest

from eval import bench_decode_cost as bench
from eval.decode_cost_model import PROFILES, HostCpu
from eval.decode_cost_traces import Trace, UniformTrace, load_trace

ROOT = Path(__file__).resolve().parents[1]
ROUTING_DATA = ROOT.parent / "shared" / "research" / "routing-data" / "npz"
MIB = 1 << 20
# 16 experts of hidden 2048 x intermediate 512 (bf16, TP 1): w13 4 MiB + w2 2 MiB, one expert per group
TINY = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "hidden_size": 2048, "num_experts": 16,
        "num_experts_per_tok": 2, "moe_intermediate_size": 512, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 1000, "torch_dtype": "bfloat16"}


class HandTrace(Trace):
    """The given steps, each [layers, tokens, k]."""

    def __init__(self, steps: list[np.ndarray], experts: int = 16, top_k: int = 2) -> None:
        self.name, self.experts, self.top_k, self.layers = "hand", experts, top_k, steps[0].shape[0]
        self._steps = steps

    def steps(self, batch: int, max_steps: int):
        yield from (s[:, :batch] for s in self._steps[:max_steps])


def host() -> HostCpu:
    return HostCpu("test socket", 4, 100e9, np.array([1.0, 64.0]), np.array([1e-3, 4e-3]), 6 * MIB, "test")


@pytest.fixture
def tiny_model(monkeypatch):
    monkeypatch.setitem(bench.EVAL_MODELS, "tiny", TINY)
    return "tiny"


def test_whole_stages_every_offloaded_byte_of_every_eligible_layer():
    """Qwen3-Next-80B TP 2: 3 MiB shards, groups of 2 (paper V-A), VAMP-15 -> 38 groups = 76 experts in each
    of the 47 eligible layers: 10.46 GiB per step (the paper's Table II reclaims 10.5 GiB)."""
    trace = UniformTrace(512, 10, 48, seed=1)
    result = bench.replay(trace, "qwen3-next-80b-a3b", 2, 0.15, PROFILES["h100-pcie"], host(), 4, 3)
    assert result["offloaded_experts_per_layer"] == 76 and result["eligible_layers"] == 47
    assert result["modes"]["whole"]["staged_bytes_per_step"] == 76 * 3 * MIB * 47


def test_routed_counts_the_routed_offloaded_rows_and_ignores_padding(tiny_model):
    """VAMP-25 of 16 experts offloads [12, 16). Layer 0 is the first MoE layer (resident, never counted)."""
    step = np.array([[[12, 13], [14, 15]],  # first MoE layer: ignored
                     [[12, 3], [13, 12]],  # rows 12, 13; pairs 3
                     [[0, -1], [15, -1]]])  # row 15; pair 1; -1 is padding
    result = bench.replay(HandTrace([step, step]), tiny_model, 1, 0.25, PROFILES["h200"], host(), 2, 2)
    assert result["offloaded_experts_per_layer"] == 4
    modes = result["modes"]
    assert modes["routed"]["staged_bytes_per_step"] == 3 * 6 * MIB
    assert modes["host"]["host_pairs_per_step"] == 4
    assert modes["host"]["host_bytes_read_per_step"] == 3 * 6 * MIB
    assert modes["whole"]["staged_bytes_per_step"] == 2 * 4 * 6 * MIB
    # step 2 routes the same rows into the same aliased slot rows: the slot cache copies nothing again
    assert modes["routed+cache"]["staged_bytes_per_step"] == 3 * 6 * MIB / 2


def test_padding_only_step_stages_nothing(tiny_model):
    step = np.full((3, 2, 2), -1)
    modes = bench.replay(HandTrace([step]), tiny_model, 1, 0.25, PROFILES["h200"], host(), 2, 1)["modes"]
    assert modes["routed"]["staged_bytes_per_step"] == 0 and modes["host"]["host_pairs_per_step"] == 0


def test_routing_order_stages_less_on_a_skewed_trace(tiny_model):
    """The hot experts are the high-index ones, which index order offloads; the order moves them back."""
    rng = np.random.default_rng(0)
    weights = np.arange(1, 17, dtype=float) ** 3
    steps = [np.stack([np.stack([rng.choice(16, 2, replace=False, p=weights / weights.sum()) for _ in range(2)])
                       for _ in range(3)]) for _ in range(300)]
    modes = bench.replay(HandTrace(steps), tiny_model, 1, 0.25, PROFILES["h200"], host(), 2, 300)["modes"]
    assert modes["routed+order"]["staged_bytes_per_step"] < 0.5 * modes["routed"]["staged_bytes_per_step"]


def test_json_has_exactly_the_issue_schema(tmp_path):
    host_json = tmp_path / "host.json"
    host_json.write_text(json.dumps({"cpu": "test", "dtypes": {"bfloat16": {"expert_bytes": 6 * MIB, "points": [
        {"tokens": 1, "median_ms": 1.0}, {"tokens": 64, "median_ms": 4.0}]}}}))
    out = tmp_path / "out.json"
    assert bench.main(["--trace", "uniform", "--batch", "1,4", "--max-steps", "3", "--host-json", str(host_json),
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"validation", "rows"}
    assert set(data["validation"]) == {"paper_tpot_ms", "modelled_tpot_ms", "best_mode", "best_mode_tpot_ms"}
    assert data["validation"]["paper_tpot_ms"] == 224.0
    keys = {"trace", "model", "tp", "ratio", "profile", "batch", "mode", "staged_bytes_per_step",
            "staged_ratio_to_whole", "host_pairs_per_step", "tpot_overhead"}
    assert data["rows"] and all(set(row) == keys for row in data["rows"])
    assert {row["mode"] for row in data["rows"]} >= {"whole", "routed", "routed+order", "host", "auto"}
    assert all(row["trace"] == "uniform" and row["staged_ratio_to_whole"] <= 1.0 for row in data["rows"])


def test_bad_flags_are_refused_before_any_replay(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--profile", "a100", "--host-json", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2 and "--profile a100" in capsys.readouterr().err


def test_a_real_trace_replays_through_routed_py():
    """DeepSeek-V2-Lite's routing (64 experts, top-6): the replay's counts equal routed.py's on its first
    steps (checked inside the replay) and the routing order never stages more than index order there."""
    if not ROUTING_DATA.is_dir():
        pytest.skip(f"routing data not found at {ROUTING_DATA} (../shared/research/routing-data)")
    trace = load_trace("deepseek-v2-lite", ROUTING_DATA)
    result = bench.replay(trace, "deepseek-v2-lite", 1, 0.15, PROFILES["h100-pcie"], host(), 4, 200)
    modes = result["modes"]
    assert result["tokens_per_step"] == 4 and result["steps"] == 200
    assert 0 < modes["routed"]["staged_bytes_per_step"] < modes["whole"]["staged_bytes_per_step"]
    assert modes["routed+order"]["staged_bytes_per_step"] <= modes["routed"]["staged_bytes_per_step"]
