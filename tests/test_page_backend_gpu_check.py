"""eval/gpu_check.py must run unchanged on a lent GPU: it compiles, and its --dry-run runs its own backend
and remap checks on host pages here (the GPU sections report "no CUDA device: skipped")."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "eval" / "gpu_check.py"


def test_gpu_check_compiles():
    subprocess.run([sys.executable, "-m", "py_compile", str(SCRIPT)], check=True)


def test_gpu_check_dry_run_runs_its_checks_on_host_pages(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"].startswith("no CUDA device: skipped")
    assert report["staging"] == {"status": "no CUDA device: skipped"}
    assert report["backend"]["ok"] is True and report["backend"]["experts_restored_exactly"] is True
    assert report["remap"]["data_survived_remap"] is True and report["remap"]["remap_ms_per_gib"] > 0
    assert report["failed_sections"] == []
