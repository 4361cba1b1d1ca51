"""The Grafana dashboard (eval/grafana/vamp-dashboard.json) shows data from a real server.

- Without a server: every panel the issue asks for is there, and every series a query names is one
  our metrics module publishes or one the installed SGLang defines.
- With one: a real Prometheus (Debian's `prometheus` package, installed here with apt-get when it is
  missing and this is root on Debian; otherwise the test skips and says so) scrapes a CPU server with
  VAMP on every second while a short multi-turn load outgrows the start-up pool; then every query of
  every panel, run by Prometheus itself, must return at least one finite value. (This is how we found
  that Prometheus 2.x stores `vamp:step` as `vamp_step`: prometheus_client 0.26 escapes ':' in
  OpenMetrics sample names, so the queries match `vamp[:_]step`.)
"""

import concurrent.futures as cf
import json
import math
import os
import random
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, free_port, get_json, post_json
from vamp_sglang.integration.metrics.prometheus import GAUGES

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "eval" / "grafana" / "vamp-dashboard.json"
MODEL = ROOT / "models" / "tiny-qwen3-moe"  # shared by the server tests
SGLANG_METRICS = Path(__import__("sglang").__file__).parent / "srt" / "observability"
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s"}
POOL_TOKENS = 1024  # the load's reusable prefixes outgrow it: VAMP offloads and evicts
SESSIONS, TURNS, FIRST_TOKENS, GROWTH_TOKENS, NEW_TOKENS = 4, 3, 256, 64, 32


def _targets():
    return [(panel["title"], target["expr"]) for panel in json.loads(DASHBOARD.read_text())["panels"]
            for target in panel["targets"]]


def test_dashboard_has_the_panels_the_issue_lists():
    titles = " | ".join(p["title"].lower() for p in json.loads(DASHBOARD.read_text())["panels"])
    for words in ("pool", "offload ratio", "decisions per action", "staged", "staging wait", "hit rate",
                  "ttft", "tpot", "preemptions"):
        assert words in titles, f"no panel for {words!r}: {titles}"


def test_every_series_is_published_by_vamp_or_defined_by_the_installed_sglang():
    vamp = {name for name, _, _ in GAUGES} | {"vamp:decisions_total"}
    sglang_source = "".join(p.read_text() for p in SGLANG_METRICS.glob("*.py"))
    for title, expr in _targets():
        names = [f"{prefix}:{name}" for prefix, name in re.findall(r"\b(vamp|sglang)\[:_\]([a-z_]+)", expr)]
        assert names, f"{title}: no vamp or sglang series in {expr}"
        for name in names:
            if name.startswith("vamp:"):
                assert name in vamp, f"{title}: {name} is not a vamp:* series (vamp_sglang/integration/metrics/prometheus.py)"
            else:
                base = re.sub(r"_(bucket|count|sum)$", "", name)
                assert f'name="{base}"' in sglang_source, f"{title}: SGLang does not define {base}"


def _prometheus_binary() -> str | None:
    """`prometheus`, installing Debian's package when it is missing and this is root with apt-get."""
    if shutil.which("prometheus"):
        return shutil.which("prometheus")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"],
                 ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]):
        if subprocess.run(argv, check=False, env=env, capture_output=True, timeout=900).returncode:
            return None
    return shutil.which("prometheus")


def _query(prom_url: str, expr: str) -> list[dict]:
    url = f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _wait_for(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


def _session(url: str, seed: int) -> None:
    """A closed-loop chat: each turn resends the last prompt and its answer plus new tokens."""
    rng, ids = random.Random(seed), []
    for _ in range(TURNS):
        ids += [rng.randrange(10, 2000) for _ in range(FIRST_TOKENS if not ids else GROWTH_TOKENS)]
        out = post_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
        ids += out["output_ids"]


@pytest.fixture(scope="module")
def prometheus_binary():
    binary = _prometheus_binary()
    if binary is None:
        pytest.skip("Debian's prometheus package is not installed and cannot be installed here (needs root "
                    "and apt-get): `apt-get install prometheus`, then rerun")
    return binary


@pytest.mark.server
def test_every_panel_query_returns_data_from_a_real_prometheus(prometheus_binary, tmp_path):
    model = ensure_tiny_model(MODEL)
    setup = ServerSetup(str(model), max_total_tokens=POOL_TOKENS, log_dir=str(tmp_path / "logs"))
    flags = ("--vamp-max-offload-ratio", "0.07", "--vamp-restore-after-steps", "0")  # one group: 4x the pool
    with Server(setup, ServerConfig("dashboard", flags)) as server:
        prom_port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "vamp", "static_configs": [
                {"targets": [f"127.0.0.1:{server.port}"]}]}]}))
        prom_url = f"http://127.0.0.1:{prom_port}"
        with open(tmp_path / "prometheus.log", "w") as log:
            prom = subprocess.Popen([prometheus_binary, f"--config.file={config}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}"],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_for(lambda: urllib.request.urlopen(f"{prom_url}/-/ready", timeout=5).status == 200,
                      "Prometheus to be ready")
            _wait_for(lambda: [r for r in _query(prom_url, 'up{job="vamp"} == 1')], "the first scrape")
            with cf.ThreadPoolExecutor(SESSIONS) as pool:
                list(pool.map(lambda s: _session(server.url, s), range(SESSIONS)))
            stats = get_json(f"{server.url}/vamp/stats")
            time.sleep(3.0)  # a few scrapes after the load
            answers = {}
            for title, expr in _targets():
                query = expr
                for var, value in GRAFANA_VARS.items():
                    query = query.replace(var, value)
                answers[(title, expr)] = [float(r["value"][1]) for r in _query(prom_url, query)]
        finally:
            prom.terminate()
            prom.wait(timeout=30)
    assert stats["kv_pool"]["tokens"] > POOL_TOKENS and stats["decisions"]["offload"] >= 1, stats
    empty = [f"{title}: {expr}" for (title, expr), values in answers.items()
             if not any(math.isfinite(v) for v in values)]
    assert not empty, "queries without data:\n" + "\n".join(empty)
