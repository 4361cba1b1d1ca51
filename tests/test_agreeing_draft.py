"""`python -m vamp_sglang.tiny_moe OUT --arch A --agreeing-draft AGREE_DIR` (vamp_sglang/tiny_moe/agreeing_draft.py):
the checkpoint copied with its token embeddings scaled by DOMINANCE and its MTP input projection (DeepSeek's
`eh_proj`, Qwen3-Next's `mtp.fc`, over [embedding; hidden]) set to [DOMINANCE * I | 0], so the draft layer reads
the next token's embedding at the dominance the target's hidden state carries the current one; and the target
it leaves is then about a bigram model, whose next token the draft can predict. The servers that serve it:
tests/test_speculative_cpu_server.py, test_speculative_vamp_server.py, test_qwen3_next_speculative_server.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from vamp_sglang.tiny_moe.__main__ import main
from vamp_sglang.tiny_moe.agreeing_draft import DOMINANCE, write_agreeing_draft
from vamp_sglang.tiny_moe.checkpoint import MANIFEST, WEIGHTS, make_checkpoint
from vamp_sglang.tiny_moe.deepseek import MTP_WEIGHTS

SMALL = {"layers": 3, "experts": 16, "hidden": 64, "intermediate": 32, "vocab": 512}
PROJECTION = {"deepseek_v3": "model.layers.3.eh_proj.weight", "qwen3_next": "mtp.fc.weight"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each arch's checkpoint and its agreeing copy, the DeepSeek one through the CLI."""
    root = tmp_path_factory.mktemp("agree")
    main([str(root / "v3"), "--arch", "deepseek_v3", "--layers", "3", "--experts", "16", "--hidden", "64",
          "--intermediate", "32", "--agreeing-draft", str(root / "v3-agree")])
    nxt = make_checkpoint(root / "next", arch="qwen3_next", **SMALL | {"layers": 4, "kv_heads": 2,
                                                                        "shared_intermediate": 32})
    return {"deepseek_v3": (root / "v3", root / "v3-agree"),
            "qwen3_next": (nxt, write_agreeing_draft(nxt, root / "next-agree"))}


@pytest.mark.parametrize("arch", sorted(PROJECTION))
def test_the_draft_reads_the_next_tokens_embedding_at_the_targets_dominance(written, arch):
    source, agree = written[arch]
    before, after = load_file(str(source / WEIGHTS)), load_file(str(agree / WEIGHTS))
    embed = "model.embed_tokens.weight"
    assert torch.equal(after[embed], before[embed] * DOMINANCE)
    assert all(torch.equal(after[n], t) for n, t in before.items() if n != embed)
    draft_before, draft = load_file(str(source / MTP_WEIGHTS)), load_file(str(agree / MTP_WEIGHTS))
    name = PROJECTION[arch]
    assert all(torch.equal(draft[n], t) for n, t in draft_before.items() if n != name)
    hidden = draft[name].shape[0]
    next_embedding, target_hidden = torch.randn(hidden), torch.randn(hidden) * 100
    mixed = draft[name] @ torch.cat([next_embedding, target_hidden])
    assert torch.allclose(mixed, DOMINANCE * next_embedding, atol=1e-4)  # the hidden half is dropped
    assert not (agree / MANIFEST).exists()  # never reused as the checkpoint its spec draws
    assert json.loads((agree / "config.json").read_text()) == json.loads((source / "config.json").read_text())


def _same_pick_share(path) -> float:
    """The share of 16 random contexts ending in the same token whose greedy next token (transformers) is
    that token's most frequent one, over three last tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    same = 0
    for last in (11, 57, 203):
        contexts = torch.randint(10, 500, (16, 12), generator=generator)
        contexts[:, -1] = last
        with torch.no_grad():
            picks = model(contexts).logits[:, -1].argmax(-1)
        same += int((picks == picks.mode().values).sum())
    return same / (3 * 16)


def test_the_scaled_target_is_about_a_bigram_model(written):
    """The draft predicts f(next token) only if the target's choice after a token hardly depends on the
    tokens before it: so it is on the agreeing copy (42 of 48 here), and not on the random checkpoint."""
    source, agree = written["deepseek_v3"]
    agreeing, random_weights = _same_pick_share(agree), _same_pick_share(source)
    assert agreeing >= 0.8 and random_weights <= agreeing - 0.3, (agreeing, random_weights)


def test_a_checkpoint_without_an_mtp_layer_or_the_checkpoints_own_directory_is_refused(written, tmp_path):
    plain = make_checkpoint(tmp_path / "qwen", arch="qwen3_moe", **SMALL)
    with pytest.raises(ValueError, match="--agreeing-draft.*no MTP layer"):
        write_agreeing_draft(plain, tmp_path / "agree")
    source, _ = written["qwen3_next"]
    with pytest.raises(ValueError, match="other than the checkpoint's"):
        write_agreeing_draft(source, source)
