"""Routing traces for the decode-cost bench (issue 49): per decode step, every MoE layer's top-k expert ids.

Sources: `../shared/research/routing-data/npz/` (formats and provenance in its README; statistics in
`../shared/research/routing-stats.md`), read in place, never copied. Three layouts:

- `seq` traces (DeepSeek-V2-Lite over 2,099 prompts, Qwen3.6-35B-A3B over one request): tokens in text
  order per sequence. A step of batch B takes one token from each of B lanes (continuous batching): a lane
  reads its sequence in order and, at its end, takes the next sequence of a shared FIFO (cycling). Lane j
  starts j/B of the way into sequence j, so lanes finish at different times as in a steady state rather
  than all at once. A one-sequence trace thus gives B staggered copies of that request, which share its
  working set: fewer distinct experts per step than B independent requests would route. A replay stops
  before any token would be read twice (at most tokens / B steps).
- `step` traces (Qwen1.5-MoE-A2.7B in vLLM, 25 GSM8K requests): the engine's real decode steps; batch B
  takes rows 0..B-1 of each step (the engine keeps row order), so B above the live batch (25 -> 11) gets
  the live batch only (the bench reports the tokens it actually had).
- `uniform`: no trace, every token's k experts drawn uniformly without replacement (seeded).

A step is an int64 array [layers, tokens, k]; -1 marks padding and is ignored downstream (as SGLang's
top-k ids use -1 for masked slots).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO.parent / "shared" / "research" / "routing-data" / "npz"


@dataclass(frozen=True)
class TraceSpec:
    """A named trace and the model (capacity-planner name or a config of eval/decode_cost_models.py) it
    routes, with the TP degree its bf16 weights need on 80-94 GB GPUs."""

    file: str | None
    model: str
    tp: int


TRACES = {
    "deepseek-v2-lite": TraceSpec("deepseek-v2-lite-chat-int8_hf_puffin2000+webglm100_prefill.npz",
                                  "deepseek-v2-lite", 1),
    "qwen3.6-35b-a3b": TraceSpec("qwen3.6-35b-a3b-4bit_vllm_1seq.npz", "qwen3.6-35b-a3b", 2),
    "qwen1.5-moe-vllm": TraceSpec("qwen1.5-moe-a2.7b-chat_vllm0.11_gsm8k25_5layers.npz", "qwen1.5-moe-a2.7b", 1),
    "uniform": TraceSpec(None, "qwen3-next-80b-a3b", 2),
}


class TraceError(ValueError):
    """A trace that cannot be read or does not fit the model; the message names the flag."""


class Trace:
    """A routing source: `experts`, `top_k`, `layers` (MoE layers it logs, in model order, the first MoE
    layer first where logged) and `steps(batch, max_steps)`."""

    name: str
    experts: int
    top_k: int
    layers: int
    logs_first_layer: bool = True  # whether logged layer 0 is the model's first MoE layer

    def steps(self, batch: int, max_steps: int) -> Iterator[np.ndarray]:
        raise NotImplementedError


class SeqTrace(Trace):
    def __init__(self, name: str, topk: np.ndarray, seq: np.ndarray, experts: int, top_k: int) -> None:
        self.name, self.experts, self.top_k, self.layers = name, experts, top_k, topk.shape[1]
        self._topk = topk
        starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
        self._bounds = list(zip(starts.tolist(), np.r_[starts[1:], len(seq)].tolist(), strict=True))

    def steps(self, batch: int, max_steps: int) -> Iterator[np.ndarray]:
        n_seq = len(self._bounds)
        lanes = []  # per lane: [position, end]
        for j in range(batch):
            first, end = self._bounds[j % n_seq]
            lanes.append([first + (end - first) * j // batch, end])
        queue = batch % n_seq
        rows = np.empty(batch, dtype=np.int64)
        for _ in range(min(max_steps, len(self._topk) // batch)):  # no token is read twice
            for j, lane in enumerate(lanes):
                if lane[0] >= lane[1]:
                    lane[0], lane[1] = self._bounds[queue]
                    queue = (queue + 1) % n_seq
                rows[j] = lane[0]
                lane[0] += 1
            yield self._topk[rows].transpose(1, 0, 2).astype(np.int64)


class StepTrace(Trace):
    def __init__(self, name: str, topk: np.ndarray, step: np.ndarray, row: np.ndarray, step_kind: np.ndarray,
                 experts: int, top_k: int, layer_ids: list[int]) -> None:
        self.name, self.experts, self.top_k, self.layers = name, experts, top_k, topk.shape[1]
        self.logs_first_layer = layer_ids[0] == 0
        self.layer_ids = layer_ids
        decode = np.flatnonzero(step_kind == 2)
        order = np.lexsort((row, step))
        self._steps = [order[step[order] == s] for s in decode.tolist()]  # each step's rows, in row order
        self._topk = topk

    def steps(self, batch: int, max_steps: int) -> Iterator[np.ndarray]:
        for rows in self._steps[:max_steps]:
            yield self._topk[rows[:batch]].transpose(1, 0, 2).astype(np.int64)


class UniformTrace(Trace):
    def __init__(self, experts: int, top_k: int, layers: int, seed: int = 0) -> None:
        self.name, self.experts, self.top_k, self.layers = "uniform", experts, top_k, layers
        self._seed = seed

    def steps(self, batch: int, max_steps: int) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self._seed + batch)
        for _ in range(max_steps):
            keys = rng.random((self.layers, batch, self.experts))
            yield np.argpartition(keys, self.top_k - 1, axis=2)[:, :, :self.top_k].astype(np.int64)


def load_trace(name_or_path: str, data_dir: Path = DATA_DIR) -> Trace:
    """A named trace (TRACES) or an .npz path in the routing-data format; `uniform` is built by the caller
    (it takes the model's shape)."""
    spec = TRACES.get(name_or_path)
    path = data_dir / spec.file if spec and spec.file else Path(name_or_path)
    if not path.is_file():
        raise TraceError(f"--trace {name_or_path}: {path} not found (the routing data lives in "
                         f"../shared/research/routing-data/npz/)")
    data = np.load(path)
    meta = json.loads(str(data["meta"]))
    name = next((n for n, s in TRACES.items() if s.file == path.name), path.stem)
    experts, top_k = int(meta["num_experts"]), int(meta["top_k"])
    if meta.get("layout") == "seq":
        return SeqTrace(name, data["topk"], data["seq"], experts, top_k)
    if meta.get("layout") == "step":
        return StepTrace(name, data["topk"], data["step"], data["row"], data["step_kind"], experts, top_k,
                         [int(i) for i in data["layers"]])
    raise TraceError(f"--trace {name_or_path}: layout {meta.get('layout')!r} has no decode-step order "
                     "(only 'seq' and 'step' traces can be replayed)")
