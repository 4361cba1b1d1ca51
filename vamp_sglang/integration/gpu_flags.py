"""SGLang flags on the GPU path that VAMP sets or refuses, read from argv without importing SGLang.

CUDA graphs stay on while experts are offloaded (issue 10): the staging hook is an `eager_on_graph`
break (moe_staging.py), which runs between the segments of SGLang's *breakable* graphs and is a plain
call inside a *full* graph, where the copies would be frozen at capture. So with VAMP on:
- decode graphs use the breakable backend; SGLang's default is full, so the launcher adds
  `--cuda-graph-backend-decode breakable` unless the user chose a backend or turned decode graphs off;
- prefill graphs keep SGLang's CUDA default (breakable), or run eager when disabled;
- an explicit `full` for either phase (flag or `--cuda-graph-config` JSON, which wins in SGLang) is
  refused at start, as is `--enable-torch-compile` (breakable graphs have no torch.compile support,
  and a compiled CPU graph would trace the staging hooks);
- PD disaggregation is refused on every device: our KV pages are created without the GPUDirect-RDMA flag,
  which transfer engines need to register them, and the disaggregated allocators are not growable;
- `SGLANG_ENABLE_ASYNC_ASSERT` (SGLang's debug probes) is refused off CPU: the KV pools' out-of-bounds probe
  compares each write's index with `self.size + self.page_size`, a Python int a captured graph keeps
  (mem_cache/memory_pool.py:2906 MHA, :4952 MLA; utils/async_probe.py:184-201), so the first write to a
  grown row fails the device assert. CPU servers capture no graphs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from vamp_sglang.config import ConfigError

STAGING_GRAPH_BACKENDS = ("breakable", "disabled")
ASYNC_ASSERT = "SGLANG_ENABLE_ASYNC_ASSERT"
_TRUE = ("true", "1", "yes", "y")  # what SGLang's EnvBool reads as on (environ.py:143-150)


def _view(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--cuda-graph-backend-decode", default=None)
    p.add_argument("--cuda-graph-backend-prefill", default=None)
    p.add_argument("--cuda-graph-config", default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-decode-cuda-graph", action="store_true")
    p.add_argument("--enable-torch-compile", action="store_true")
    p.add_argument("--disaggregation-mode", default="null")
    return p.parse_known_args(argv)[0]


def _json_backends(raw: str | None) -> dict[str, str]:
    """Phase -> backend named in `--cuda-graph-config` (SGLang reports malformed JSON itself)."""
    try:
        parsed = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    return {phase: cfg["backend"] for phase, cfg in parsed.items() if isinstance(cfg, dict) and "backend" in cfg}


def with_staging_graphs(argv: list[str], device: str) -> list[str]:
    """SGLang's argv with VAMP on: refuse what cannot stage experts, default decode graphs to breakable."""
    sg = _view(argv)
    if sg.disaggregation_mode != "null":
        raise ConfigError(f"--disaggregation-mode {sg.disaggregation_mode} is not supported with "
                          f"--vamp-max-offload-ratio > 0 (VAMP's KV pages are not RDMA-registrable)")
    if sg.enable_torch_compile:
        raise ConfigError("--enable-torch-compile is not supported with --vamp-max-offload-ratio > 0 "
                          "(breakable CUDA graphs, which keep expert staging live, have no torch.compile support)")
    if device != "cuda":
        return argv
    from_json = _json_backends(sg.cuda_graph_config)
    chosen = {"decode": from_json.get("decode", sg.cuda_graph_backend_decode),
              "prefill": from_json.get("prefill", sg.cuda_graph_backend_prefill)}
    for phase, backend in chosen.items():
        if backend is not None and backend not in STAGING_GRAPH_BACKENDS:
            flag = "--cuda-graph-config" if phase in from_json else f"--cuda-graph-backend-{phase}"
            raise ConfigError(f"{flag}: a {backend} {phase} CUDA graph would replay stale staged experts with "
                              f"--vamp-max-offload-ratio > 0; use breakable or disabled")
    if chosen["decode"] is None and not (sg.disable_cuda_graph or sg.disable_decode_cuda_graph):
        return argv + ["--cuda-graph-backend-decode", "breakable"]
    return argv


def environment_refusal(environ: Mapping[str, str], device: str) -> str | None:
    """The refusal of an SGLang debug variable whose probe a CUDA graph keeps at the start-up pool size."""
    if device != "cpu" and environ.get(ASYNC_ASSERT, "").lower() in _TRUE:
        return (f"{ASYNC_ASSERT}={environ[ASYNC_ASSERT]} is not supported with --vamp-max-offload-ratio > 0 "
                f"on a GPU (its KV out-of-bounds probe keeps the start-up pool size inside CUDA graphs, so "
                f"the first token in a grown row fails the device assert); unset it")
    return None
