"""Router weights fitted so that a tiny checkpoint routes like a real model's trace (issue 49).

Random router weights route almost uniformly: every expert takes about k/E of the tokens and a token's
experts have nothing to do with the previous token's. Real routing (../shared/research/routing-stats.md)
is mildly skewed (DeepSeek-V2-Lite: the hottest quarter of a layer's experts takes about a third of the
selections) and reuses experts from step to step (26 % of a token's experts were its predecessor's, 9 %
under uniform routing). What staging and residency by routing cost and save depends on both, so
`python -m vamp_sglang.tiny_moe OUT --routing-from NPZ` sets each layer's router so that the checkpoint
reproduces, per layer, the trace's expert-share curve and its step-to-step reuse (B = 1).

How, per layer in forward order (a layer's router inputs depend on the routers before it):
- the router's inputs x_t on the built-in corpus are captured from a transformers forward;
- slow directions: whitened inputs z_t, then the eigenvectors of the symmetrised lag-1 covariance
  E[z_t z_{t-1}^T] (slow feature analysis): along the top ones z_t barely changes between tokens;
- expert e's router row is s_e (sqrt(rho) a_e + sqrt(1 - rho) b_e) in whitened coordinates, a_e a random
  unit vector among the slow directions and b_e among the others: rho sets the reuse (bisection) and the
  per-expert scale s_e the share of selections (multiplicative fit), because an expert whose logits
  spread wider reaches the top k more often;
- the trace's sorted shares go to the experts in a seeded random order, so hot experts are not the
  low (or high) indices that residency by index would keep.

Targets for another expert count or top-k: the share curve is resampled (cumulative share against
expert quantile), and the reuse keeps its place between uniform (k/E) and full reuse.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROUTED_ARCHS = ("qwen3_moe",)  # softmax top-k routers with a plain [E, hidden] weight
SEQUENCE_TOKENS = 128  # the fit corpus is cut into sequences of this length
FIT_TOKENS = 4096  # at most this many tokens of it
BOS_MARK = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"  # DeepSeek's BOS, as the trace spells it
SLOW_SHARE = 1 / 16  # share of the hidden directions counted as slow
SCALE_ROUNDS, REUSE_ROUNDS = 16, 12  # scale rounds per reuse round, each starting where the last ended
FINAL_FITS = 3  # scale fits at the chosen rho


@dataclass(frozen=True)
class RoutingStats:
    """Per layer: selection shares sorted hottest first (each row sums to 1) and lag-1 reuse at B = 1
    (the mean share of a token's k experts that the previous token of its sequence also selected)."""

    experts: int
    top_k: int
    shares: np.ndarray  # [layers, experts]
    reuse: np.ndarray  # [layers]

    def hot_quarter(self) -> np.ndarray:
        """Per layer, the share of selections taken by the hottest 25 % of experts (routing-stats.md 4.1)."""
        return self.shares[:, :math.ceil(self.experts / 4)].sum(axis=1)

    def target(self, layers: int, experts: int, top_k: int) -> RoutingStats:
        """These statistics for a model of `layers` layers, E experts and top-k: trace layers picked evenly,
        share curves resampled, reuse kept at the same place between k/E and 1."""
        picks = np.round(np.linspace(0, len(self.reuse) - 1, layers)).astype(int)
        grid, own = np.linspace(0, 1, experts + 1), np.linspace(0, 1, self.experts + 1)
        shares = np.stack([np.diff(np.interp(grid, own, np.concatenate([[0], np.cumsum(self.shares[p])])))
                           for p in picks])
        uniform, own_uniform = top_k / experts, self.top_k / self.experts
        reuse = uniform + (self.reuse[picks] - own_uniform) / (1 - own_uniform) * (1 - uniform)
        return RoutingStats(experts, top_k, shares, reuse)


def routing_stats(topk: np.ndarray, seq: np.ndarray, experts: int) -> RoutingStats:
    """Statistics of routes `topk` [tokens, layers, k] whose rows are in each sequence's token order."""
    tokens, layers, top_k = topk.shape
    follows = np.flatnonzero(seq[1:] == seq[:-1]) + 1  # rows whose previous row is the same sequence's
    shares, reuse = np.zeros((layers, experts)), np.zeros(layers)
    for layer in range(layers):
        ids = topk[:, layer, :].astype(np.int64)
        shares[layer] = np.sort(np.bincount(ids.ravel(), minlength=experts))[::-1] / ids.size
        chosen = np.zeros((tokens, experts), dtype=bool)
        np.put_along_axis(chosen, ids, True, axis=1)
        reuse[layer] = (chosen[follows] & chosen[follows - 1]).sum() / max(len(follows) * top_k, 1)
    return RoutingStats(experts, top_k, shares, reuse)


def trace_stats(npz: str | Path) -> RoutingStats:
    """Statistics of a routing trace in the routing-data format (`topk` [tokens, layers, k], `seq`)."""
    data = np.load(npz)
    if "seq" not in data or data["topk"].ndim != 3:
        raise ValueError(f"--routing-from {npz}: needs `topk` [tokens, layers, k] and `seq` in token order")
    return routing_stats(data["topk"], data["seq"], _trace_experts(data))


def trace_geometry(npz: Path) -> dict[str, int]:
    """The trace's expert count and top-k, the CLI's defaults under --routing-from."""
    data = np.load(npz)
    return {"experts": _trace_experts(data), "top_k": int(data["topk"].shape[-1])}


def _trace_experts(data) -> int:
    """The meta's `num_experts`, else one past the highest id routed."""
    if "meta" in data:
        return int(json.loads(str(data["meta"])).get("num_experts", int(data["topk"].max()) + 1))
    return int(data["topk"].max()) + 1


def check_routing_source(spec, npz: Path) -> None:
    """A ValueError naming the flag unless `npz` can set this spec's routers (before anything is written)."""
    if spec.arch not in ROUTED_ARCHS or spec.quant != "none":
        raise ValueError(f"--routing-from needs --arch {' or '.join(ROUTED_ARCHS)} without --quant, "
                         f"not {spec.arch} with quant={spec.quant}")
    if not npz.is_file():
        raise ValueError(f"--routing-from {npz}: no such file")


# ---- the fit ---------------------------------------------------------------------------------------

def _select(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> torch.Tensor:
    return torch.topk(x @ weight.T, top_k, dim=1).indices


def _measure(ids: torch.Tensor, follows: torch.Tensor, experts: int) -> tuple[torch.Tensor, float]:
    """(selections per token per expert, lag-1 reuse) of the chosen ids [tokens, k]."""
    chosen = torch.zeros(ids.shape[0], experts, dtype=torch.bool).scatter_(1, ids, True)
    rates = chosen.sum(0).double() / ids.shape[0]
    reuse = (chosen[follows] & chosen[follows - 1]).sum().item() / (len(follows) * ids.shape[1])
    return rates, reuse


def fit_layer(x: torch.Tensor, follows: torch.Tensor, rates: torch.Tensor, reuse: float, top_k: int,
              generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """Router weight [E, hidden] for inputs x [tokens, hidden] (float64) that selects expert e at `rates[e]`
    per token with lag-1 reuse `reuse` over the rows `follows`; also the mixing rho it chose."""
    experts, hidden = len(rates), x.shape[1]
    centred = x - x.mean(0)
    variance, basis = torch.linalg.eigh(centred.T @ centred / len(x))
    white = basis / variance.clamp_min(variance.max() * 1e-8).sqrt()  # z = centred @ white
    z = centred @ white
    lag = z[follows].T @ z[follows - 1] / len(follows)
    directions = torch.linalg.eigh((lag + lag.T) / 2).eigenvectors  # slowest last
    slow_count = max(2, round(hidden * SLOW_SHARE))
    slow, fast = directions[:, -slow_count:], directions[:, :-slow_count]
    a = torch.randn(experts, slow_count, generator=generator, dtype=torch.float64)
    b = torch.randn(experts, hidden - slow_count, generator=generator, dtype=torch.float64)
    a, b = a @ slow.T, b @ fast.T
    a, b = a / a.norm(dim=1, keepdim=True), b / b.norm(dim=1, keepdim=True)

    scale = torch.ones(experts, dtype=torch.float64)

    def fitted(rho: float) -> tuple[torch.Tensor, float]:
        rows = (math.sqrt(rho) * a + math.sqrt(1 - rho) * b) @ white.T
        for _ in range(SCALE_ROUNDS):
            got, _ = _measure(_select(x, scale[:, None] * rows, top_k), follows, experts)
            scale.mul_((rates / got.clamp_min(0.25 / len(x))) ** 0.3)
            scale.div_(scale.mean())
        weight = scale[:, None] * rows
        return weight, _measure(_select(x, weight, top_k), follows, experts)[1]

    lo, hi = 0.0, 1.0
    for _ in range(REUSE_ROUNDS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fitted(mid)[1] < reuse else (lo, mid)
    for _ in range(FINAL_FITS):
        weight, _ = fitted((lo + hi) / 2)
    return weight / (x @ weight.T).std(), (lo + hi) / 2  # logits of unit spread, as the random router's


def trace_texts(npz: str | Path, split: int) -> list[str]:
    """The prompts of a trace that carries its token strings (`tok_blob`, `tok_off`, byte-level BPE as
    the DeepSeek-V2-Lite trace stores them) in split `split`, as plain text; [] for a trace without."""
    data = np.load(npz)
    if "tok_blob" not in data:
        return []
    blob, off, seq = data["tok_blob"].tobytes(), data["tok_off"], data["seq"]
    texts = []
    for prompt in np.flatnonzero(data["split"] == split):
        rows = np.flatnonzero(seq == prompt)
        text = "".join(blob[off[r]:off[r + 1]].decode(errors="replace") for r in rows)
        texts.append(text.replace("\u0120", " ").replace("\u010a", "\n").replace(BOS_MARK, ""))
    return texts


def fit_ids(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as a right-padded batch [prompts, SEQUENCE_TOKENS] of token ids and its mask of real tokens,
    each prompt from its first token (as a server sees a request) and cut at SEQUENCE_TOKENS, until
    FIT_TOKENS tokens. Right padding leaves every real token's causal forward as it is alone."""
    rows, total = [], 0
    for text in texts:
        if total >= FIT_TOKENS:
            break
        rows.append(tokenizer(text)["input_ids"][:SEQUENCE_TOKENS])
        total += len(rows[-1])
    ids = torch.full((len(rows), SEQUENCE_TOKENS), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), SEQUENCE_TOKENS, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), True
    return ids, mask


def model_routes(model, input_ids: torch.Tensor) -> np.ndarray:
    """The top-k ids [tokens, layers, k] every router of a transformers Qwen3-MoE picks for `input_ids`
    [sequences, tokens] (rows sequence-major), from a plain forward."""
    picked: dict[int, torch.Tensor] = {}  # layer -> [rows, k]
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _args, out, i=i: picked.__setitem__(i, out[2])) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([picked[i] for i in range(len(picked))], dim=1).numpy()


def router_inputs(model, layer, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What `layer`'s router reads for the real tokens of `input_ids` [tokens, hidden] (float64)."""
    captured: list[torch.Tensor] = []
    hook = layer.mlp.gate.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        hook.remove()
    return captured[0].double().reshape(-1, captured[0].shape[-1])[mask.reshape(-1)]


def fit_routers(out: Path, spec, npz: Path) -> dict:
    """Set every router of the checkpoint in `out` (written by `write_checkpoint`) to route like `npz`;
    rewrites the weights file and returns the manifest's `routing` record (targets and fitted figures)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = trace_stats(npz).target(spec.layers, spec.experts, spec.top_k)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from vamp_sglang.tiny_moe.tokenizer import _corpus

    input_ids, mask = fit_ids(AutoTokenizer.from_pretrained(out), trace_texts(npz, 0) or _corpus())
    seq = np.repeat(np.arange(input_ids.shape[0]), input_ids.shape[1])[mask.reshape(-1).numpy()]
    follows = torch.from_numpy(np.flatnonzero(seq[1:] == seq[:-1]) + 1)
    weights, rhos = {}, []
    for layer_id, layer in enumerate(model.model.layers):
        generator = spec.generator(f"routing/{layer_id}")
        order = torch.randperm(spec.experts, generator=generator)  # which expert gets which share
        rates = torch.empty(spec.experts, dtype=torch.float64)
        rates[order] = torch.from_numpy(target.shares[layer_id]) * spec.top_k
        weight, rho = fit_layer(router_inputs(model, layer, input_ids, mask), follows, rates,
                                float(target.reuse[layer_id]), spec.top_k, generator)
        layer.mlp.gate.weight.data.copy_(weight.float())
        weights[f"model.layers.{layer_id}.{spec.moe}.gate.weight"] = weight.float().contiguous()
        rhos.append(round(rho, 4))
    fitted = routing_stats(model_routes(model, input_ids)[mask.reshape(-1).numpy()], seq, spec.experts)
    tensors = load_file(str(out / "model.safetensors")) | weights
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return {"from": str(npz), "rho": rhos,
            "target_hot_quarter": np.round(target.hot_quarter(), 4).tolist(),
            "fitted_hot_quarter": np.round(fitted.hot_quarter(), 4).tolist(),
            "target_reuse": np.round(target.reuse, 4).tolist(), "fitted_reuse": np.round(fitted.reuse, 4).tolist()}
