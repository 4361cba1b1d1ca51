"""The decode-cost bench's staging accounting applied to a served run (issue 49), to check that what a
server counts is what the bench predicts for the same routing.

"The same routing" here: the same tokens through the same weights. Each request the server answered
(its prompt ids, the prompt tokens its prefix cache served, its output ids) is run once more through the
checkpoint in transformers, teacher-forced on prompt + output, and every MoE layer's top-k ids are read
(tiny_moe/routing.py `model_routes`). The requests are grouped into the steps a server serving them one at
a time runs: one prefill step of the uncached prompt tokens, then one decode step per output token but the
last (the step that consumes it). Those steps go through the bench's own residency and counting
(decode_cost_replay.py: `residency` on the capacity planner's geometry, `count_step`), giving the bytes
routed staging copies, the pairs the host computes and the bytes whole staging copies. Routing computed
twice in float32 can differ where two experts' logits tie to rounding, so the figures agree closely, not
necessarily exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from eval.decode_cost_replay import count_step, residency
from vamp_sglang.memory.geometry import geometry_from_config
from vamp_sglang.tiny_moe.routing import model_routes

Request = tuple[Sequence[int], int, Sequence[int]]  # prompt ids, cached prompt tokens, output ids


def served_steps(model, requests: Sequence[Request]) -> Iterator[np.ndarray]:
    """Each step's top-k ids [MoE layers, tokens, k], requests served one at a time."""
    for prompt, cached, output in requests:
        routes = model_routes(model, torch.tensor([[*prompt, *output[:-1]]]))  # [tokens, layers, k]
        yield routes[cached:len(prompt)].transpose(1, 0, 2).astype(np.int64)
        for position in range(len(prompt), len(prompt) + len(output) - 1):
            yield routes[position:position + 1].transpose(1, 0, 2).astype(np.int64)


def predict_served(model_dir: str | Path, ratio: float, requests: Sequence[Request]) -> dict[str, int]:
    """What one rank (TP 1) of a server at VAMP-`ratio` stages and computes on the host for `requests`."""
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(model_dir) / "config.json").read_text())
    geo = geometry_from_config(config, 1, config.get("torch_dtype") or config.get("dtype") or "float32")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    res = residency(geo, ratio, SimpleNamespace(name=str(model_dir), layers=len(geo.moe_layer_ids),
                                                logs_first_layer=True))
    totals = {"steps": 0, "routed_bytes": 0, "host_pairs": 0, "whole_bytes": 0, "offloaded_experts": res.offloaded}
    for ids in served_steps(model, requests):
        step = count_step(ids[res.trace_first_eligible:], None, res)
        totals["steps"] += 1
        totals["routed_bytes"] += int(step.rows.sum()) * res.row_bytes
        totals["host_pairs"] += int(step.pairs.sum())
        totals["whole_bytes"] += res.whole_bytes_per_step
    return totals
