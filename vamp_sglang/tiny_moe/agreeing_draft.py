"""A tiny checkpoint whose MTP draft agrees with its target, so speculative decoding accepts most drafts.

Why: the tiny checkpoints' weights are random, so their own MTP layer almost never predicts the target's
next token and a verify keeps one token a step; the accepted-token paths (the verify's later chain
positions, the accepted cache locations, the draft extend over accepted tokens) then never run. Scaling the
token embeddings by DOMINANCE makes the target's last hidden state about DOMINANCE * embed(current token), a
bigram model (next = f(current)); a draft input projection of [DOMINANCE * I | 0] (DeepSeek's `eh_proj`,
Qwen3-Next's `mtp.fc`, both over [embedding; hidden]) hands the MTP layer embed(next token) at the same
dominance, so through the shared head it predicts f(next token), the target's following choice. Where the
small layer outputs tip an argmax the two differ, and the verify rejects the draft.

    python -m vamp_sglang.tiny_moe OUT --arch deepseek_v3 --agreeing-draft AGREE_DIR   (or --arch qwen3_next)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from vamp_sglang.tiny_moe.checkpoint import MANIFEST, WEIGHTS
from vamp_sglang.tiny_moe.deepseek import MTP_WEIGHTS

DOMINANCE = 30.0  # embedding scale against layer outputs of unit RMS (each layer reads RMS-normed input)
INPUT_PROJECTIONS = ("eh_proj.weight", "mtp.fc.weight")  # DeepSeek's NextN layer, Qwen3-Next's MTP layer


def write_agreeing_draft(source: str | Path, out: str | Path) -> Path:
    """Copy the checkpoint `source` to `out` with its embeddings scaled and its MTP input projection set to
    [DOMINANCE * I | 0]; returns `out`. The manifest is left behind: `out` is no longer the checkpoint its
    spec draws, so make_checkpoint must never reuse it as one."""
    import torch
    from safetensors.torch import load_file, save_file

    source, out = Path(source), Path(out)
    if not (source / MTP_WEIGHTS).is_file():
        raise ValueError(f"--agreeing-draft: {source} has no MTP layer ({MTP_WEIGHTS}); write it with "
                         "--arch deepseek_v3 or --arch qwen3_next")
    if out.resolve() == source.resolve():
        raise ValueError("--agreeing-draft needs a directory other than the checkpoint's")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.name not in (WEIGHTS, MTP_WEIGHTS, MANIFEST):
            shutil.copy(path, out / path.name)
    target = load_file(str(source / WEIGHTS))
    target["model.embed_tokens.weight"] *= DOMINANCE
    save_file(target, str(out / WEIGHTS), metadata={"format": "pt"})
    draft = load_file(str(source / MTP_WEIGHTS))
    (name,) = [n for n in draft if n.endswith(INPUT_PROJECTIONS)]
    hidden = draft[name].shape[0]
    projection = torch.cat([DOMINANCE * torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    draft[name] = projection.to(draft[name].dtype)
    save_file(draft, str(out / MTP_WEIGHTS), metadata={"format": "pt"})
    return out
