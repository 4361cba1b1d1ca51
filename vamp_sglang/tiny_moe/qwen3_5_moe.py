"""Qwen3.5 / Qwen3.6 MoE (`--arch qwen3_5_moe`) scaled down, text only; SGLang's Qwen3_5MoeForCausalLM.

The real models (Qwen3.6-35B-A3B, Qwen3.5-397B-A17B) are Qwen3-Next's successors: the same hybrid of Gated
DeltaNet linear attention and query-gated full attention every 4th layer, routed experts plus one gated
shared expert in every layer, (1 + weight) RMSNorms. What changes on the checkpoint side is the linear
attention's projections: Qwen3.5 ships q/k/v, z, b and a as four separate tensors (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`) laid out head-contiguous, where Qwen3-Next interleaves them per key
head in two fused ones; SGLang merges them into `in_proj_qkvz` / `in_proj_ba` at load and splits them back
per step (on CPU with `fused_qkvzba_split_reshape_cat_contiguous_cpu`). The published checkpoints wrap this
text model in a vision-language class (`Qwen3_5MoeForConditionalGeneration`); SGLang registers the text
model on its own (models/qwen3_5_text.py), which is what this checkpoint names, with transformers'
`Qwen3_5MoeTextConfig` (model_type `qwen3_5_moe_text`) and `Qwen3_5MoeForCausalLM` as the reference.
`write_wrapper` (`--wrapper WRAP_DIR`) writes the same weights in the wrapper's layout, with a tiny vision tower.

Qwen3-Next's tiny geometry otherwise (8 layers, attention at 3 and 7, 2 key and 4 value heads of 64, 128
experts of 256 top-2, a shared expert of 256): 96 MiB of experts per layer, 2 KiB of KV per token.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from vamp_sglang.tiny_moe.qwen3_next import Qwen3NextSpec


@dataclass(frozen=True)
class Qwen3_5MoeSpec(Qwen3NextSpec):
    """Qwen3-Next's layers with Qwen3.5's separate, head-contiguous linear-attention projections."""

    arch: ClassVar[str] = "qwen3_5_moe"
    architecture: ClassVar[str] = "Qwen3_5MoeForCausalLM"
    config_class: ClassVar[str] = "Qwen3_5MoeTextConfig"

    mtp_layers: ClassVar[int] = 0  # Qwen3.5's MTP layer (SGLang's qwen3_5_mtp) is not written

    def _linear_attention_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        """q/k/v, z, b and a as four projections; conv, decay, gated norm and output as Qwen3-Next's."""
        fused = super()._linear_attention_shapes(p)
        a, h = f"{p}.linear_attn", self.hidden
        key = self.linear_key_heads * self.linear_head_dim
        value = self.linear_value_heads * self.linear_head_dim
        del fused[f"{a}.in_proj_qkvz.weight"], fused[f"{a}.in_proj_ba.weight"]
        return fused | {
            f"{a}.in_proj_qkv.weight": (2 * key + value, h),
            f"{a}.in_proj_z.weight": (value, h),
            f"{a}.in_proj_b.weight": (self.linear_value_heads, h),
            f"{a}.in_proj_a.weight": (self.linear_value_heads, h),
        }


WRAPPER_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
WRAPPER_VISION = {"depth": 1, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128, "patch_size": 16,
                  "num_position_embeddings": 64, "spatial_merge_size": 2, "temporal_patch_size": 2}
_TEXT_ONLY_FILES = ("config.json", "model.safetensors", "vamp_tiny_moe.json")


def write_wrapper(text_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Write text_dir's Qwen3.5 checkpoint in the layout the published ones ship, `WRAPPER_ARCHITECTURE`.

    The config becomes transformers' `Qwen3_5MoeConfig`: the text config under `text_config`, a one-block vision
    tower of width 64 under `vision_config`, and the image/video/vision-boundary ids as the last four of the
    tiny vocabulary. The language model's tensors move under `model.language_model.` (SGLang's
    Qwen3_5MoeForConditionalGeneration.load_weights maps them back to `model.`); the vision tower's are
    transformers' random-initialised `Qwen3_5MoeVisionModel` under `model.visual.`. A processor
    (`Qwen3VLProcessor`) is saved beside them, since SGLang builds one for every multimodal model at start.
    Same language-model weights as text_dir, so a text-only request gives the same greedy tokens.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Qwen3_5MoeConfig
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    text_dir, out = Path(text_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = json.loads((text_dir / "config.json").read_text())
    if text.get("architectures") != [Qwen3_5MoeSpec.architecture]:
        raise ValueError(f"{text_dir} is not a tiny_moe --arch qwen3_5_moe checkpoint")
    for path in text_dir.iterdir():
        if path.is_file() and path.name not in _TEXT_ONLY_FILES:
            shutil.copy(path, out / path.name)
    vocab = text["vocab_size"]
    config = Qwen3_5MoeConfig(
        text_config={k: v for k, v in text.items() if k not in ("architectures", "transformers_version")},
        vision_config=WRAPPER_VISION | {"out_hidden_size": text["hidden_size"]},
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1, tie_word_embeddings=text["tie_word_embeddings"])
    config.architectures = [WRAPPER_ARCHITECTURE]
    torch.manual_seed(seed)
    visual = Qwen3_5MoeVisionModel._from_config(config.vision_config, dtype=torch.float32)
    tensors = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: tensor
               for name, tensor in load_file(text_dir / "model.safetensors").items()}
    tensors |= {f"model.visual.{name}": tensor.contiguous() for name, tensor in visual.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    geometry = {"patch_size": WRAPPER_VISION["patch_size"], "merge_size": WRAPPER_VISION["spatial_merge_size"],
                "temporal_patch_size": WRAPPER_VISION["temporal_patch_size"]}
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**geometry), tokenizer=AutoTokenizer.from_pretrained(out),
                     video_processor=Qwen3VLVideoProcessor(**geometry)).save_pretrained(out)
    return out
