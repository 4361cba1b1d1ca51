"""Two real SGLang "nodes" on loopback whose key files differ (issue 14): node 0's controller rejects
node 1 and logs it, node 1 logs that it cannot get in, every agreement round times out so no rank
remaps anything, and the server keeps serving every request.

Each round waits out the time-outs (5 s per phase on the leader, 10 s on the follower, about 20 s a
round), so the workload stays below the pool: the rounds are the start-up ones. A run past the cliff
(5 sessions x 4 turns) took 17 minutes here and served every request."""

import json
from pathlib import Path

import pytest

from eval.bench import BenchSpec
from eval.demo_multinode import run_two_nodes
from eval.multiturn import MultiTurnSpec
from eval.servers import ServerSetup, ensure_tiny_model
from vamp_sglang.controller.keys import generate_key_file

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (several servers each)

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"  # shared by the server tests
POOL_TOKENS = 2048
SESSIONS, TURNS = 2, 2


def _decisions(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_node_with_another_key_is_rejected_and_the_server_keeps_serving_without_remaps(tmp_path):
    model = ensure_tiny_model(MODEL)
    keys = (str(tmp_path / "node0.key"), str(tmp_path / "node1.key"))
    for key in keys:
        generate_key_file(key)
    log = tmp_path / "decisions.jsonl"
    setup = ServerSetup(str(model), "cpu", POOL_TOKENS, tp_size=2, log_dir=str(tmp_path / "logs"))
    spec = BenchSpec("multiturn", multiturn=MultiTurnSpec(
        SESSIONS, TURNS, first_turn_tokens=256, turn_growth_tokens=64, output_tokens=16, block_tokens=32).validate())
    result, network = run_two_nodes(setup, ("--vamp-max-offload-ratio", "0.15", "--vamp-decision-log", str(log)),
                                    keys, spec)
    assert (result["completed"], result["failed"]) == (SESSIONS * TURNS, 0)
    assert any("does not hold this deployment's key" in line for line in network["rejected_on_node0"])
    assert any("is --vamp-controller-key-file the same file on every node?" in line
               for line in network["refused_on_node1"])
    assert network["timed_out_on_node0"], "no agreement round ran"
    rank0, rank1 = _decisions(log), _decisions(Path(f"{log}.rank1"))
    assert not any(d["outcome"].get("tokens_added", 0) for d in rank0 + rank1)
    stats = result["vamp_stats_after"]
    assert stats["kv_pool"]["tokens"] == POOL_TOKENS and stats["experts"]["offloaded_groups"] == 0
