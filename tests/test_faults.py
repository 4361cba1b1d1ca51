"""VAMP_SGLANG_FAULT: parsed strictly, refused by the launcher before anything loads."""

import subprocess
import sys

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError
from vamp_sglang.faults import Faults, FaultSpecError, InjectedFault

MODEL = ["--model-path", "models/tiny-qwen3-moe"]


@pytest.mark.parametrize("spec, words", [
    ("remap", "must be KIND:P"), ("swap:0.5", "must be KIND:P"), ("remap:often", "P must be a number"),
    ("remap:1.5", "P must be in [0, 1]"), ("remap:-0.1", "P must be in [0, 1]"),
    ("remap:0.1,remap:0.2", "names 'remap' twice"),
])
def test_malformed_specs_are_refused_with_the_reason(spec, words):
    with pytest.raises(FaultSpecError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Faults.parse(spec)


def test_probabilities_fire_as_asked_and_are_counted():
    assert not Faults.parse(None).active and not Faults.parse("").fires("remap")
    always = Faults.parse("remap:1, agree-timeout:0")
    assert always.active and always.fires("remap") and not always.fires("agree-timeout")
    with pytest.raises(InjectedFault, match="injected remap fault at the test"):
        always.check("remap", "the test")
    assert always.fired == {"remap": 2, "publish": 0, "agree-timeout": 0}
    sometimes = Faults.parse("remap:0.2", seed=1)
    hits = sum(sometimes.fires("remap") for _ in range(10_000))
    assert 1_700 < hits < 2_300


def test_launcher_refuses_a_bad_spec_before_sglang_loads(monkeypatch):
    monkeypatch.setenv("VAMP_SGLANG_FAULT", "remap:2")
    with pytest.raises(ConfigError, match="VAMP_SGLANG_FAULT"):
        launch_server.prepare(MODEL)
    proc = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", *MODEL], check=False,
                          capture_output=True, text=True, timeout=60, env={"VAMP_SGLANG_FAULT": "remap:x",
                                                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "VAMP_SGLANG_FAULT item 'remap:x'" in proc.stderr
