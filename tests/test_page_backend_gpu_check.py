"""eval/gpu_check.py must run unchanged on a lent GPU (issue 10): `--require-gpu` refuses at once without
one, `--dry-run` lists the sections, and without a GPU the same script runs its sections on host pages at
toy sizes, importing neither SGLang nor pyzmq."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "eval" / "gpu_check.py"
SECTIONS = ["backend", "driver", "remap", "graphs", "overlap", "routed", "routing_order", "host_experts", "state",
            "prefill_stream", "side_stream_capture", "resize_rollback", "state_pool_alloc", "compaction_probe",
            "hicache_budget", "grown_attention", "sglang_fp8_moe"]


def run(*args, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_require_gpu_exits_nonzero_within_seconds_without_a_gpu(tmp_path):
    start = time.monotonic()
    proc = run("--require-gpu", "--json", str(tmp_path / "out.json"), tmp_path=tmp_path)
    assert proc.returncode == 2 and "no usable GPU" in proc.stderr
    assert time.monotonic() - start < 30 and not (tmp_path / "out.json").exists()


def test_dry_run_lists_the_sections(tmp_path):
    proc = run("--dry-run", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == SECTIONS
    assert len({line.index(" GPU") for line in lines}) == 1  # one column for "GPU ...", however long the name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the host smoke run is for machines without a GPU")
def test_without_a_gpu_the_sections_run_on_host_pages(tmp_path):
    out = tmp_path / "report" / "gpu_check.json"
    proc = run("--json", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == json.loads(out.read_text())
    assert report["status"].startswith("no GPU") and report["driver"] == {"skipped": "needs a GPU"}
    assert report["failed_sections"] == [] and report["forbidden_imports"] == []
    assert report["backend"]["experts_restored_exactly"] is True
    assert report["remap"]["data_survived_remap"] is True and report["remap"]["remap_gib_per_s"] > 0
    graphs = report["graphs"]
    assert graphs["first_eager_forward_after_offload_exact"] and graphs["split_w2_wait_exact"]
    assert graphs["one_page_same_through_every_address"] and graphs["no_page_leaked"]
    assert [b["batch"] for b in report["overlap"]["batches"]] == [1, 16, 64]
    assert report["overlap"]["outputs_exact"] is True  # whole and routed staging, against resident experts
    whole_bytes = report["overlap"]["staged_bytes_per_layer"] * report["overlap"]["staged_layers"]
    routed_bytes = [b["routed_bytes_per_step"] for b in report["overlap"]["batches"]]
    assert 0 < routed_bytes[0] < whole_bytes and routed_bytes[-1] == whole_bytes  # batch 64 routes to them all
    routed = report["routed"]  # issue 12: routed, whole and auto steps exact; routed stages fewer bytes
    assert routed["ok"] and routed["routed_exact"] and routed["auto_exact"] and routed["routed_stages_fewer_bytes"]
    assert report["routing_order"]["ok"] and report["routing_order"]["eager_after_swap_exact"]  # issue 49
    assert report["host_experts"]["graphs"]["ok"] and report["host_experts"]["graphs"]["host_pairs"] > 0
    assert report["state"]["ok"] and report["state"]["slot_clear_hits_every_layer"]  # issue 11: state pool
    assert report["side_stream_capture"] == {"skipped": "needs a GPU"}  # CUDA graphs and streams only
    assert report["resize_rollback"]["ok"] and report["resize_rollback"]["kv_experts_exact"]  # issue 19 item 2
    assert report["state_pool_alloc"]["ok"] and report["state_pool_alloc"]["sglang_allocation_given_back_first"]
    probe = report["compaction_probe"]  # issue 48 defect 5: the batched probe answers as the per-node loop
    assert probe["ok"] and probe["movable"]["answer"] is True and probe["not_movable"]["answer"] is False
    for name in ("hicache_budget", "grown_attention", "sglang_fp8_moe"):  # CUDA graphs, pinning, SGLang kernels
        assert report[name] == {"skipped": "needs a GPU"}


@pytest.mark.gpu
def test_gpu_check_passes_on_a_gpu(tmp_path):
    """Every CUDA path of issue 10 in one run: staging under captured graphs, the arena, runs, timing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none here)")
    proc = run("--require-gpu", "--json", str(tmp_path / "gpu_check.json"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    graphs = report["graphs"]  # replay after offload bit for bit against the same graph before it (issue 19)
    assert graphs["replay_after_offload_exact"] and graphs["hooks_idle_while_capturing"]
    assert graphs["stale_slots_read_without_the_breaks"] and graphs["replay_close_to_eager"]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_the_routed_sections_row_copy_takes_fp8_experts(dtype):
    """The first H200 run stopped in the routed section: index_copy_ has no FP8 kernel (nor on CPU)."""
    from eval.gpu_sections.routed_staging import copy_rows

    gen = torch.Generator().manual_seed(0)
    experts = torch.randn(6, 4, 8, generator=gen).to(dtype)
    host = torch.randn(3, 4, 8, generator=gen).to(dtype)
    want = experts.clone()
    dst, src = torch.tensor([5, 1, 3]), torch.tensor([0, 2, 2])
    for d, s in zip(dst.tolist(), src.tolist(), strict=True):
        want[d] = host[s]
    copy_rows(experts, host, dst, src)
    assert torch.equal(experts.view(torch.uint8), want.view(torch.uint8))


def test_a_section_that_raises_half_way_fails_alone():
    """The first H200 run: the routed section raised with pages mapped, and the state section after it
    failed its own leak check on them. Each section now gets a backend of its own; what it leaves fails
    it and is freed."""
    from eval.gpu_check import HOST_GRAN, run_section
    from vamp_sglang.memory import select_backend

    backends = []

    def make_backend():
        backends.append(select_backend("host", "cpu", granularity_bytes=HOST_GRAN))
        return backends[-1]

    def raises_with_pages_mapped(backend, gpu):
        base = backend.reserve(2 * HOST_GRAN)
        backend.map_run(base, [backend.create(HOST_GRAN) for _ in range(2)])
        raise RuntimeError("half way")

    def clean(backend, gpu):
        return {"ok": True, "counts_at_start": dataclasses.asdict(backend.live_counts())}

    report = {}
    run_section(report, "broken", raises_with_pages_mapped, make_backend, gpu=False)
    run_section(report, "next", clean, make_backend, gpu=False)
    assert report["broken"]["ok"] is False and "half way" in report["broken"]["error"]
    assert report["broken"]["left_live"] == {"reservations": 1, "mappings": 2, "handles": 2}
    assert report["next"]["ok"] is True
    assert report["next"]["counts_at_start"] == {"reservations": 0, "mappings": 0, "handles": 0}
    assert backends[0] is not backends[1] and backends[0].live_counts() == backends[1].live_counts()

    def no_backend():
        raise RuntimeError("no context")

    run_section(report, "unbuilt", clean, no_backend, gpu=False)  # reported, not raised
    assert report["unbuilt"]["ok"] is False and "no context" in report["unbuilt"]["error"]


def test_the_hicache_budget_section_accepts_a_pool_pinned_before_the_check(monkeypatch):
    """Issue 48 defect 4, the section's own verdicts on the host: pinning (a stand-in cudart here) takes the
    pool out of MemAvailable; the check counts it once and accepts; as it was, it counted it twice and
    refused."""
    from types import SimpleNamespace

    from eval.gpu_sections import hicache_budget

    assert hicache_budget.mem_available_bytes() > 0  # this machine's /proc/meminfo
    available = [64 << 20]
    pool_bytes = int(available[0] * hicache_budget.POOL_FRACTION) // (1 << 21) << 21

    def register(ptr, size, flags):
        available[0] -= size
        return 0

    monkeypatch.setattr(hicache_budget, "mem_available_bytes", lambda: available[0])
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=register,
                                                                      cudaHostUnregister=lambda ptr: 0))
    result = hicache_budget.check(None, gpu=True)
    assert result["pool_gib"] == round(pool_bytes / 2**30, 2) and result["registration_counted_as_used"]
    assert result["ok"] and result["accepted"] and result["refused_when_counted_twice"]
