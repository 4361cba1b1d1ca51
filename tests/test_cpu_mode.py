"""CPU mode: the environment, the default flags, the stand-in `sgl_kernel` ops, and a real import of
SGLang's CPU scheduler path through the stand-in."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vamp_sglang.cpu import SHIM_DIR, cpu_environment, cpu_server_defaults

SHIM_INIT = SHIM_DIR / "sgl_kernel" / "__init__.py"


@pytest.fixture(scope="module")
def shim():
    """The stand-in loaded under another name, so this process never gets a fake `sgl_kernel`."""
    spec = importlib.util.spec_from_file_location("vamp_test_sgl_kernel_shim", SHIM_INIT,
                                                  submodule_search_locations=[str(SHIM_INIT.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its `from .speculative import` resolves under this name
    spec.loader.exec_module(module)
    return module


def test_environment_puts_shim_first_and_keeps_user_paths():
    env = cpu_environment(base_env={"PYTHONPATH": os.pathsep.join(["/a", str(SHIM_DIR), "/b"])})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SHIM_DIR), "/a", "/b"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["TORCHDYNAMO_DISABLE"] == "1"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env and "SGLANG_NCCL_SO_PATH" not in env


def test_environment_respects_user_thread_choices():
    env = cpu_environment(2, base_env={"OMP_NUM_THREADS": "4", "SGLANG_CPU_OMP_THREADS_BIND": "0-3|4-7"})
    assert env["OMP_NUM_THREADS"] == "4" and env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-3|4-7"


@pytest.mark.parametrize("tp_size", [2, 3])
def test_environment_for_tensor_parallel(tp_size):
    env = cpu_environment(tp_size, base_env={"SGLANG_NCCL_SO_PATH": "/usr/lib/libnccl.so.2"})
    ranks = env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")
    assert len(ranks) == tp_size and all(int(core) in os.sched_getaffinity(0) for core in ranks)
    assert not Path(env["SGLANG_NCCL_SO_PATH"]).exists()  # NCCL must not load on CPU


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_tp_size_names_the_flag(bad):
    with pytest.raises(ValueError, match="--tp-size"):
        cpu_environment(bad)


def test_server_defaults():
    defaults = cpu_server_defaults()
    assert defaults == ["--attention-backend", "torch_native", "--sleep-on-idle", "--dtype", "float32"]
    assert defaults is not cpu_server_defaults()  # callers may extend their copy


def test_assign_req_to_token_pool_matches_kernel_semantics(shim):
    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    out_cache_loc = torch.arange(100, 107, dtype=torch.int64)
    shim.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([3, 0]), torch.tensor([6, 4]), out_cache_loc, 10
    )
    expected = torch.zeros(4, 10, dtype=torch.int32)
    expected[2, 3:6] = torch.tensor([100, 101, 102])
    expected[0, 0:4] = torch.tensor([103, 104, 105, 106])
    assert torch.equal(req_to_token, expected)


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer(shim):
    buffers = [torch.randn(16, 2, 8) for _ in range(3)] + [torch.randn(16, 4, dtype=torch.float64)]
    before = [b.clone() for b in buffers]
    # built the way SGLang's MHATokenToKVPool builds data_ptrs / data_strides
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in buffers])
    tgt, src = torch.tensor([5, 9, 12]), torch.tensor([1, 2, 3])
    shim.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for buffer, old in zip(buffers, before):
        expected = old.clone()
        expected[tgt] = old[src]
        assert torch.equal(buffer, expected)
    shim.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt[:0], src[:0])  # nothing to move


def test_unsupported_ops_say_which_op(shim):
    for name in shim.UNSUPPORTED_OPS:
        with pytest.raises(NotImplementedError, match=name):
            getattr(shim, name)()


def test_shim_is_not_visible_outside_cpu_mode():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE")}
    code = "import importlib.util; s = importlib.util.find_spec('sgl_kernel'); print(s.origin if s else '')"
    origin = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert str(SHIM_DIR) not in origin.stdout


CPU_IMPORT_PROBE = """
import json, sys, types
import sglang.srt.managers.scheduler, sglang.srt.model_executor.model_runner
import sglang.srt.models.qwen3_moe, sglang.srt.models.mixtral
import sgl_kernel
from sglang.srt.utils import is_cpu
from sglang.srt.mem_cache import allocation
from sglang.kernels.ops.kvcache import cache_move
imported = sorted({  # by the op's own name: SGLang imports some under an alias
    value.__name__ for module in list(sys.modules.values()) if isinstance(module, types.ModuleType)
    and module.__name__.startswith("sglang")
    for value in vars(module).values()
    if callable(value) and getattr(value, "__module__", None) == "sgl_kernel"
})
print(json.dumps({
    "shim_file": sgl_kernel.__file__,
    "is_cpu": is_cpu(),
    "allocation_uses_shim":
        allocation.assign_req_to_token_pool_cpu is sgl_kernel.assign_req_to_token_pool_cpu,
    "cache_move_uses_shim":
        cache_move.copy_all_layer_kv_cache_cpu is sgl_kernel.copy_all_layer_kv_cache_cpu,
    "imported": imported,
}))
"""


def test_sglang_cpu_path_imports_through_the_shim(shim):
    env = {**os.environ, **cpu_environment()}
    result = subprocess.run(
        [sys.executable, "-c", CPU_IMPORT_PROBE],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(probe["shim_file"]) == SHIM_INIT
    assert probe["is_cpu"] and probe["allocation_uses_shim"] and probe["cache_move_uses_shim"]
    # Exactly the ops SGLang 0.5.23's CPU path imports: a name missing here would be an ImportError
    # above; a stale one means SGLang changed and the shim needs review.
    assert probe["imported"] == sorted(shim.IMPLEMENTED_OPS + shim.UNSUPPORTED_OPS)
