"""tiny_moe --routing-from (issue 49): the routing statistics, and a checkpoint whose routers were fitted to
the DeepSeek-V2-Lite trace routes held-out prompts like the trace routes them (transformers forward)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eval.decode_cost_traces import DATA_DIR
from vamp_sglang.tiny_moe.__main__ import main
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint, read_manifest
from vamp_sglang.tiny_moe.routing import model_routes, routing_stats, trace_texts

DEEPSEEK = DATA_DIR / "deepseek-v2-lite-chat-int8_hf_puffin2000+webglm100_prefill.npz"
needs_trace = pytest.mark.skipif(not DEEPSEEK.is_file(), reason=f"routing trace {DEEPSEEK} not present")


def test_stats_of_known_routes():
    experts, k = 8, 2
    same = np.tile(np.array([[[0, 1]]]), (10, 1, 1))  # every token picks experts 0 and 1
    stats = routing_stats(same, np.zeros(10, dtype=int), experts)
    assert stats.reuse.tolist() == [1.0] and stats.hot_quarter().tolist() == [1.0]
    rng = np.random.default_rng(0)
    uniform = np.stack([rng.permutation(experts)[:k] for _ in range(20000)])[:, None, :]
    stats = routing_stats(uniform, np.zeros(20000, dtype=int), experts)
    assert stats.reuse[0] == pytest.approx(k / experts, abs=0.01)
    assert stats.hot_quarter()[0] == pytest.approx(0.25, abs=0.01)
    split = routing_stats(same, np.arange(10), experts)  # ten one-token sequences: no pair to reuse across
    assert split.reuse[0] == 0


def test_target_resamples_shares_and_keeps_reuse_between_uniform_and_one():
    stats = routing_stats(np.array([[[0, 1]], [[0, 2]], [[0, 1]]]), np.zeros(3, dtype=int), 4)
    same = stats.target(1, 4, 2)
    assert np.allclose(same.shares, stats.shares) and np.allclose(same.reuse, stats.reuse)
    wider = stats.target(3, 8, 2)
    assert wider.shares.shape == (3, 8) and np.allclose(wider.shares.sum(axis=1), 1)
    lift = (stats.reuse[0] - 2 / 4) / (1 - 2 / 4)
    assert wider.reuse[0] == pytest.approx(2 / 8 + lift * (1 - 2 / 8))


def test_refusals_name_the_flag(tmp_path, capsys):
    for argv in ([str(tmp_path / "a"), "--routing-from", str(tmp_path / "missing.npz")],
                 [str(tmp_path / "b"), "--arch", "mixtral", "--routing-from", str(DEEPSEEK)]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and "--routing-from" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _held_out_stats(checkpoint, texts: list[str], experts: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    routes, seq = [], []
    for i, text in enumerate(texts):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        routes.append(model_routes(model, ids))
        seq.append(np.full(ids.shape[1], i))
    return routing_stats(np.concatenate(routes), np.concatenate(seq), experts)


@needs_trace
def test_fitted_checkpoint_routes_held_out_prompts_like_the_trace(tmp_path):
    """Fitted on the trace's first split (Puffin prompts), measured on its second (the 99 test prompts,
    never seen by the fit), against the trace's own routing of those same prompts, layer by layer: the
    fitted routers must be close, and closer than the random routers of the same checkpoint."""
    fitted = make_checkpoint(tmp_path / "fitted", routing_from=DEEPSEEK, experts=64, top_k=6)
    plain = make_checkpoint(tmp_path / "plain", experts=64, top_k=6)
    record = read_manifest(fitted)["routing"]
    assert np.allclose(record["fitted_reuse"], record["target_reuse"], atol=0.01)
    assert np.allclose(record["fitted_hot_quarter"], record["target_hot_quarter"], atol=0.01)

    data = np.load(DEEPSEEK)
    rows = np.isin(data["seq"], np.flatnonzero(data["split"] == 1))
    picks = np.round(np.linspace(0, data["topk"].shape[1] - 1, 6)).astype(int)
    trace = routing_stats(data["topk"][rows][:, picks], data["seq"][rows], 64)
    texts = trace_texts(DEEPSEEK, 1)
    ours, random = (_held_out_stats(c, texts, 64) for c in (fitted, plain))
    reuse_error = np.abs(ours.reuse - trace.reuse).mean()
    hot_error = np.abs(ours.hot_quarter() - trace.hot_quarter()).mean()
    assert reuse_error <= 0.04, (ours.reuse, trace.reuse)
    assert reuse_error < 0.5 * np.abs(random.reuse - trace.reuse).mean()
    assert hot_error <= 0.06 and hot_error < np.abs(random.hot_quarter() - trace.hot_quarter()).mean()


def test_a_routed_checkpoint_is_not_reused_as_a_plain_one(tmp_path, monkeypatch):
    """The manifest records the routing source, so the same spec without it is written again."""
    from vamp_sglang.tiny_moe import checkpoint

    calls = []
    monkeypatch.setattr(checkpoint, "fit_routers", lambda out, spec, npz: calls.append(npz) or {"from": str(npz)})
    source = tmp_path / "trace.npz"
    np.savez(source, topk=np.zeros((4, 1, 1), dtype=np.int16), seq=np.zeros(4, dtype=np.int32))
    out = tmp_path / "ckpt"
    fields = {"layers": 1, "experts": 4, "top_k": 1, "hidden": 32, "intermediate": 16, "heads": 2, "kv_heads": 1,
              "head_dim": 16}
    make_checkpoint(out, routing_from=source, **fields)
    make_checkpoint(out, routing_from=source, **fields)  # reused
    assert calls == [source]
    make_checkpoint(out, **fields)
    assert "routing" not in read_manifest(out) and calls == [source]
