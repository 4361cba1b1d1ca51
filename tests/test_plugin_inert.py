"""Installing vamp-sglang must not change a plain `python -m sglang.launch_server`."""

import json
import os
import subprocess
import sys

PROBE = r"""
import json
from sglang.srt.entrypoints import http_server
from sglang.srt.managers import scheduler
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
ours = [t for t, hooks in HookRegistry._hooks.items()
        for _, fn, _ in hooks if fn.__module__.startswith("vamp_sglang")]
routes = [getattr(r, "path", "") for r in http_server.app.router.routes]
print(json.dumps({"ours": ours, "vamp_route": "/vamp/stats" in routes}))
"""


def _probe(extra_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VAMP_SGLANG")}
    env.update(extra_env, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PROBE], check=False, capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_plain_sglang_gets_no_hooks_and_no_route():
    result = _probe({})
    assert result == {"ours": [], "vamp_route": False}


def test_launcher_env_turns_the_plugin_on():
    from vamp_sglang.config import VampConfig

    result = _probe(VampConfig().to_env())
    assert result["vamp_route"] is True
    assert any(t.endswith("Scheduler.__init__") for t in result["ours"])
