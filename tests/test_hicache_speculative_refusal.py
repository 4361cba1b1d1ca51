"""HiCache with a speculative draft and VAMP on is refused by the launcher, naming both flags, before anything
loads (vamp_sglang/refusals/hicache.py): SGLang gives the draft's KV a host copy of its own (packed MTP layers
or a sidecar host pool) that VAMP's host-memory budget does not count. Each alone is served, and so is the
pair at ratio 0 (stock SGLang) and with NGRAM (no draft KV pool)."""

import subprocess
import sys
import time

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError

MODEL = ["--model-path", "/nonexistent/model", "--speculative-eagle-topk", "1"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "2"]
VAMP = ["--vamp-max-offload-ratio", "0.2"]


@pytest.mark.parametrize("algorithm", ["EAGLE", "NEXTN", "EAGLE3"])
def test_hicache_with_a_draft_is_refused_with_vamp_on_naming_both_flags(algorithm):
    with pytest.raises(ConfigError) as err:
        launch_server.prepare(MODEL + HICACHE + VAMP + ["--speculative-algorithm", algorithm])
    message = str(err.value)
    assert "--enable-hierarchical-cache" in message and f"--speculative-algorithm {algorithm}" in message
    assert "host" in message  # the reason: the draft's own host copy


def test_a_draft_algorithm_vamp_never_serves_is_refused_for_itself_not_for_hicache():
    """STANDALONE is refused with VAMP on whatever the cache: the refusal names it, not HiCache."""
    with pytest.raises(ConfigError) as err:
        launch_server.prepare(MODEL + HICACHE + VAMP + ["--speculative-algorithm", "STANDALONE"])
    assert "--speculative-algorithm STANDALONE" in str(err.value)
    assert "--enable-hierarchical-cache" not in str(err.value)


@pytest.mark.parametrize("flags", [
    HICACHE + ["--vamp-max-offload-ratio", "0", "--speculative-algorithm", "EAGLE"],  # stock SGLang
    HICACHE + VAMP + ["--speculative-algorithm", "NGRAM"],  # no draft KV pool
    HICACHE + VAMP,
    VAMP + ["--speculative-algorithm", "EAGLE"],
], ids=["ratio-0", "ngram", "hicache-alone", "draft-alone"])
def test_each_alone_and_the_pair_at_ratio_0_are_served(flags):
    launch_server.prepare(MODEL + flags)


def test_cli_exits_2_within_a_second_of_the_import():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", *MODEL, *HICACHE, *VAMP,
                           "--speculative-algorithm", "NEXTN"], check=False, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--enable-hierarchical-cache with --speculative-algorithm NEXTN" in proc.stderr
    assert time.monotonic() - start < 10, "validation must not wait for SGLang to import"
