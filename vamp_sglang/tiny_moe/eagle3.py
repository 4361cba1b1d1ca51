"""A tiny EAGLE3 draft for a tiny Qwen3-MoE (`--eagle3-draft`): SGLang's `LlamaForCausalLMEagle3` layout.

EAGLE3 (`--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT`) drafts with one Llama decoder
layer fed by three of the target's hidden states: `fc` maps their concatenation (3 x hidden) to hidden, and
the layer's attention reads [embed(token); fc output] (2 x hidden), hence q/k/v of twice the width. The
tensor names are those SGLang's loader maps (models/llama_eagle3.py:325-384: `midlayer` -> `layers.0`, q/k/v
and gate/up stacked); the embedding is the target's (the EAGLE worker shares it), and the draft keeps its
own `lm_head` over the whole vocabulary (`draft_vocab_size` = vocab, no d2t map). Its geometry is the
target's (hidden, heads, head_dim), its weights drawn like the target's, keyed by (seed, name).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vamp_sglang.tiny_moe.checkpoint import MANIFEST, WEIGHTS, read_manifest, spec_for

DRAFT_INTERMEDIATE = 512  # the draft layer's dense MLP width
AUX_STATES = 3  # target hidden states EAGLE3 concatenates (SGLang's default aux layers)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def draft_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int,
                 vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the draft, name -> shape."""
    m = "midlayer"
    return {
        "fc.weight": (hidden, AUX_STATES * hidden),
        f"{m}.hidden_norm.weight": (hidden,),
        f"{m}.input_layernorm.weight": (hidden,),
        f"{m}.post_attention_layernorm.weight": (hidden,),
        f"{m}.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        f"{m}.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        f"{m}.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        f"{m}.self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{m}.mlp.gate_proj.weight": (DRAFT_INTERMEDIATE, hidden),
        f"{m}.mlp.up_proj.weight": (DRAFT_INTERMEDIATE, hidden),
        f"{m}.mlp.down_proj.weight": (hidden, DRAFT_INTERMEDIATE),
        "norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }


def aux_layers(layers: int) -> list[int]:
    """Three distinct target layers whose hidden states the draft reads (SGLang's default, [2, L // 2, L - 3]
    on the last rank, repeats a layer in a 6-layer model, and then fewer than AUX_STATES are captured)."""
    if layers < 4:
        raise ValueError(f"an EAGLE3 draft reads {AUX_STATES} distinct layers: the target needs >= 4 layers "
                         f"(has {layers})")
    return [1, layers // 2, layers - 2]


def write_eagle3_draft(target_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the EAGLE3 draft of the tiny Qwen3-MoE checkpoint in target_dir into out_dir; returns out_dir."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    target, out = Path(target_dir), Path(out_dir)
    manifest = read_manifest(target)
    fields = dict(manifest["spec"])
    if fields.pop("arch") != "qwen3_moe":
        raise ValueError(f"{target}: an EAGLE3 draft is written for --arch qwen3_moe checkpoints only")
    spec = spec_for("qwen3_moe", **fields)
    target_config = json.loads((target / "config.json").read_text())
    vocab = manifest["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=DRAFT_INTERMEDIATE,
                         num_hidden_layers=1, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                         max_position_embeddings=spec.max_positions, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=None, dtype="float32",
                         eos_token_id=target_config.get("eos_token_id"),
                         pad_token_id=target_config.get("pad_token_id"))
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.draft_vocab_size = vocab
    config.eagle_config = {"use_aux_hidden_state": True,
                           "eagle_aux_hidden_state_layer_ids": aux_layers(spec.layers)}
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copy(target / name, out / name)
    shapes = draft_shapes(spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, vocab)
    draft = spec_for("qwen3_moe", **(fields | {"seed": spec.seed + 1}))  # draws of its own
    save_file({name: draft.draw(name, shape) for name, shape in shapes.items()}, str(out / WEIGHTS),
              metadata={"format": "pt"})
    (out / MANIFEST).unlink(missing_ok=True)  # not a target checkpoint
    return out
