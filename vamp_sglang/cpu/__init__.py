"""CPU mode: what SGLang 0.5.23 needs to serve with `--device cpu` on a machine without a GPU.

Four things stop a stock SGLang on CPU (see shared research `sglang-cpu.md`):
- `is_cpu()` is False unless `SGLANG_USE_CPU_ENGINE=1`, and SGLang then reaches for vllm/CUDA ops.
- With it, SGLang imports CPU ops from `sgl_kernel`, whose only PyPI build is CUDA-only and fails to
  load without libcuda. We put a stand-in package (`shim/sgl_kernel`, plain torch) FIRST on
  PYTHONPATH. It goes there only in CPU mode and only through the environment of the processes we
  start: on a GPU machine the real kernels stay in charge, and no .pth file or site hook ever
  exposes the shim to a plain `python -m sglang.launch_server`.
- Two OpenMP threads on two busy cores made matmuls about 60x slower, so `OMP_NUM_THREADS=1`
  unless the user chose a count; `--sleep-on-idle` stops the idle scheduler busy-polling a core.
- With more than one rank (`--tp-size` x `--pp-size` > 1), every rank needs an OpenMP core set
  (`SGLANG_CPU_OMP_THREADS_BIND`: one entry per global device id, which counts every stage's ranks; else
  `numa_utils.init_threads_binding` asserts, utils/numa_utils.py:463), and NCCL must be unloadable
  (`SGLANG_NCCL_SO_PATH` to a missing file) because this torch is a CUDA build and SGLang would
  otherwise build an NCCL communicator on CPU tensors; it falls back to gloo.
`TORCHDYNAMO_DISABLE=1` skips a g++ compile of a helper on the first request (start-up 40-57 s
instead of about 30 s with TP 2).

The environment must be in place before sglang is imported (`is_cpu()` is cached): the launcher puts
it in os.environ (and the shim on sys.path) first, and SGLang's spawned scheduler and detokenizer
processes inherit it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from vamp_sglang.local_config import local_model_config

SHIM_DIR = Path(__file__).resolve().parent / "shim"  # holds the stand-in `sgl_kernel` package
MISSING_NCCL_PATH = str(SHIM_DIR / "no-nccl-in-cpu-mode" / "libnccl.so.2")  # never created


def cpu_environment(world_size: int = 1, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set (on top of `base_env`, default os.environ) for a CPU server of `world_size` ranks:
    tp_size x pp_size (DP attention splits the TP group and adds none; distributed/bootstrap.py:82-87).

    Keeps a user's own OMP_NUM_THREADS, SGLANG_CPU_OMP_THREADS_BIND and TORCHDYNAMO_DISABLE.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"the rank count (--tp-size x --pp-size) must be a positive integer, got {world_size!r}")
    base = os.environ if base_env is None else base_env
    shim = str(SHIM_DIR)
    rest = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != shim]
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join([shim, *rest]),
        "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS") or "1",
        "TORCHDYNAMO_DISABLE": base.get("TORCHDYNAMO_DISABLE") or "1",
    }
    if world_size > 1:
        bind = base.get("SGLANG_CPU_OMP_THREADS_BIND") or _bind_per_rank(world_size)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = bind
        env["SGLANG_NCCL_SO_PATH"] = MISSING_NCCL_PATH
    return env


def _bind_per_rank(world_size: int) -> str:
    """One core per rank, round-robin over the cores this process may use: "0|1" for TP 2 or PP 2.

    Without the Intel AMX kernels SGLang only checks that there is one entry per rank; it binds
    nothing, so sharing a core when ranks outnumber cores is harmless.
    """
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[rank % len(cores)]) for rank in range(world_size))


def in_cpu_mode() -> bool:
    """True in the processes of a CPU server (the variable `cpu_environment` sets; SGLang's `is_cpu()`)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def cpu_server_defaults(model_path: str | None = None) -> list[str]:
    """SGLang flags CPU mode adds when the user did not give them.

    - `--attention-backend torch_native`: SGLang's CPU default, intel_amx, needs the real kernels.
    - `--sleep-on-idle`: the idle scheduler otherwise spins a core at 100%.
    - `--dtype float32`: `auto` turns a float32 checkpoint into float16
      (model_config.py `_get_and_verify_dtype`), slow on CPUs without native fp16 matmul; float32
      also keeps greedy output comparable with transformers. A quantised checkpoint (config.json has
      a `quantization_config`) gets `bfloat16`: FP8 takes bf16/fp16 activations only
      (quantization/fp8.py:326, checked by model_loader/loader.py:266).
    """
    quantised = local_model_config(model_path).get("quantization_config") is not None
    return ["--attention-backend", "torch_native", "--sleep-on-idle", "--dtype", "bfloat16" if quantised else "float32"]


__all__ = ["SHIM_DIR", "cpu_environment", "cpu_server_defaults", "in_cpu_mode"]
