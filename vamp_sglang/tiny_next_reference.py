"""A plain-torch forward of a `tiny_moe --arch qwen3_next` checkpoint, to check what a server generates.

Written from the Qwen3-Next definition (transformers' modeling_qwen3_next.py), independent of SGLang
and of our CPU ops: every step recomputes the whole sequence (causal attention over all tokens,
the Gated DeltaNet recurrence from a zero state, a zero-padded causal conv), so a server's prefix
cache, state checkpoints and decode kernels are checked against a forward that has none of them.
float32 throughout. Only what tiny checkpoints use: no biases, silu, norm_topk_prob, every layer MoE.

    python -m vamp_sglang.tiny_next_reference MODEL_DIR TOKEN_ID... [--new-tokens N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


class TinyNextReference:
    """Greedy decoding over the safetensors weights of one checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        self.config = json.loads((model_dir / "config.json").read_text())
        self.w = load_file(model_dir / "model.safetensors")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Qwen3-Next RMSNorm: scales by (1 + weight)."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config["rms_norm_eps"]) * (1 + self.w[name])

    def _attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c, w = self.config, self.w
        tokens, heads, kv_heads, d = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q, gate = (x @ w[f"{p}.q_proj.weight"].T).view(tokens, heads, 2 * d).chunk(2, dim=-1)
        q = self._norm(q, f"{p}.q_norm.weight")
        k = self._norm((x @ w[f"{p}.k_proj.weight"].T).view(tokens, kv_heads, d), f"{p}.k_norm.weight")
        v = (x @ w[f"{p}.v_proj.weight"].T).view(tokens, kv_heads, d)
        rotary = int(d * c["partial_rotary_factor"])
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
        angles = torch.arange(tokens, dtype=torch.float32)[:, None] * inv_freq
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

        def rope(t):
            rot, rest = t[..., :rotary], t[..., rotary:]
            half = torch.cat([-rot[..., rotary // 2:], rot[..., :rotary // 2]], -1)
            return torch.cat([rot * cos + half * sin, rest], -1)

        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("thd,shd->hts", q, k) * d ** -0.5
        scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(tokens, heads * d)
        return (out * torch.sigmoid(gate.reshape(tokens, heads * d))) @ w[f"{p}.o_proj.weight"].T

    def _linear_attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c, w = self.config, self.w
        tokens = x.shape[0]
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv, r = c["linear_key_head_dim"], c["linear_value_head_dim"], hv // hk
        qkvz = (x @ w[f"{p}.in_proj_qkvz.weight"].T).view(tokens, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = (x @ w[f"{p}.in_proj_ba.weight"].T).view(tokens, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], -1).T
        kernel = w[f"{p}.conv1d.weight"]  # [D, 1, W]
        mixed = F.silu(F.conv1d(F.pad(mixed, (kernel.shape[-1] - 1, 0))[None], kernel, groups=mixed.shape[0])[0]).T
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k = (t.reshape(tokens, hk, dk).repeat_interleave(r, 1) for t in (q, k))  # value head j reads key head j // r
        q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # l2norm, as Qwen3-Next
        v = v.reshape(tokens, hv, dv)
        g = -w[f"{p}.A_log"].exp() * F.softplus(a.reshape(tokens, hv) + w[f"{p}.dt_bias"])
        beta = torch.sigmoid(b.reshape(tokens, hv))
        state = torch.zeros(hv, dk, dv)
        out = torch.empty(tokens, hv, dv)
        for t in range(tokens):
            state = state * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, q[t] * dk ** -0.5)
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"]) * w[f"{p}.norm.weight"]
        out = out * F.silu(z.reshape(tokens, hv, dv))
        return out.reshape(tokens, hv * dv) @ w[f"{p}.out_proj.weight"].T

    def _moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c, w = self.config, self.w

        def mlp(h, prefix):
            return (F.silu(h @ w[f"{prefix}.gate_proj.weight"].T) * (h @ w[f"{prefix}.up_proj.weight"].T)) \
                @ w[f"{prefix}.down_proj.weight"].T

        probs = (x @ w[f"{p}.gate.weight"].T).softmax(-1)
        top, experts = probs.topk(c["num_experts_per_tok"], dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for weight, e in zip(top[t].tolist(), experts[t].tolist(), strict=True):
                out[t] += weight * mlp(x[t:t + 1], f"{p}.experts.{e}")[0]
        shared = mlp(x, f"{p}.shared_expert") * torch.sigmoid(x @ w[f"{p}.shared_expert_gate.weight"].T)
        return out + shared

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits after every position, `[len(token_ids), vocab]`."""
        h = self.w["model.embed_tokens.weight"][torch.tensor(token_ids)]
        for i, kind in enumerate(self.config["layer_types"]):
            p = f"model.layers.{i}"
            x = self._norm(h, f"{p}.input_layernorm.weight")
            h = h + (self._attention(x, f"{p}.self_attn") if kind == "full_attention"
                     else self._linear_attention(x, f"{p}.linear_attn"))
            h = h + self._moe(self._norm(h, f"{p}.post_attention_layernorm.weight"), f"{p}.mlp")
        return self._norm(h, "model.norm.weight") @ self.w["lm_head.weight"].T

    def greedy(self, token_ids: list[int], new_tokens: int) -> list[int]:
        """The new_tokens greedy continuation of token_ids."""
        ids = list(token_ids)
        for _ in range(new_tokens):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(token_ids):]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vamp_sglang.tiny_next_reference", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("token_ids", type=int, nargs="+")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    print(" ".join(map(str, TinyNextReference(args.model_dir).greedy(args.token_ids, args.new_tokens))))


if __name__ == "__main__":
    main()
