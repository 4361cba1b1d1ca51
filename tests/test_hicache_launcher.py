"""The launcher with HiCache (issue 22): VAMP on with HiCache is accepted (write-through and write-back), CPU mode
gets the `direct` io backend, and what VAMP cannot serve is refused naming the flag (tests/test_launcher_validation)."""

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError

MODEL = ["--model-path", "/nonexistent/model"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "2"]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_vamp_with_hicache_is_accepted_with_either_write_policy(policy):
    launch = launch_server.prepare(MODEL + HICACHE + ["--hicache-write-policy", policy,
                                                      "--vamp-max-offload-ratio", "0.2", "--device", "cpu"])
    assert launch.vamp.enabled and "--enable-hierarchical-cache" in launch.sglang_argv
    assert launch.sglang_argv[launch.sglang_argv.index("--radix-cache-backend") + 1] == "vamp"


@pytest.mark.parametrize("ratio", ["0", "0.2"])
def test_cpu_mode_adds_the_direct_io_backend(ratio):
    argv = launch_server.prepare(MODEL + HICACHE + ["--vamp-max-offload-ratio", ratio, "--device", "cpu"]).sglang_argv
    assert argv[argv.index("--hicache-io-backend") + 1] == "direct"


def test_a_given_direct_backend_is_kept_once_and_gpu_mode_adds_none():
    argv = launch_server.prepare(MODEL + HICACHE + ["--device", "cpu", "--hicache-io-backend", "direct"]).sglang_argv
    assert argv.count("--hicache-io-backend") == 1
    gpu = launch_server.prepare(MODEL + HICACHE + ["--vamp-max-offload-ratio", "0.2"]).sglang_argv
    assert "--hicache-io-backend" not in gpu


def test_the_kernel_io_backend_is_refused_on_cpu_even_with_vamp_off():
    with pytest.raises(ConfigError, match="--hicache-io-backend"):
        launch_server.prepare(MODEL + HICACHE + ["--vamp-max-offload-ratio", "0", "--device", "cpu",
                                                 "--hicache-io-backend", "kernel"])


def test_storage_backend_is_fine_with_vamp_off():
    launch_server.prepare(MODEL + HICACHE + ["--vamp-max-offload-ratio", "0", "--hicache-storage-backend", "file"])
