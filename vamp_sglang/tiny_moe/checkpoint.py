"""Writing one tiny checkpoint: the families there are, then tokenizer, config, weights and manifest.

A family is listed in FAMILIES, which the CLI's --arch offers. Writing is the same for every family:
train the tokenizer (the model's vocab is its actual size), build the family's transformers config, draw
every tensor the family names, save tokenizer, config and tensors (one safetensors file), and write the
manifest last, so an interrupted run is redone and a finished one is reused untouched. With
`quant="fp8"` the drawn tensors are quantised (fp8.py) and their exact bf16 source is saved in `bf16/`.
"""

from __future__ import annotations

import json
from pathlib import Path

from vamp_sglang.tiny_moe import fp8
from vamp_sglang.tiny_moe.common import TinyMoeSpec
from vamp_sglang.tiny_moe.deepseek import DeepseekV2Spec, DeepseekV3Spec
from vamp_sglang.tiny_moe.glm4_moe import Glm4MoeSpec
from vamp_sglang.tiny_moe.minimax_m2 import MiniMaxM2Spec
from vamp_sglang.tiny_moe.mixtral import MixtralSpec
from vamp_sglang.tiny_moe.qwen3_5_moe import Qwen3_5MoeSpec
from vamp_sglang.tiny_moe.qwen3_moe import Qwen3MoeSpec
from vamp_sglang.tiny_moe.qwen3_next import Qwen3NextSpec
from vamp_sglang.tiny_moe.routing import check_routing_source, fit_routers
from vamp_sglang.tiny_moe.tokenizer import train_tokenizer

FAMILIES: dict[str, type[TinyMoeSpec]] = {family.arch: family for family in (Qwen3MoeSpec, MixtralSpec,
                                                                             Qwen3NextSpec, DeepseekV3Spec,
                                                                             DeepseekV2Spec, Glm4MoeSpec,
                                                                             Qwen3_5MoeSpec, MiniMaxM2Spec)}
ARCHS = tuple(FAMILIES)
DEFAULT_ARCH = "qwen3_moe"
MANIFEST = "vamp_tiny_moe.json"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"


def spec_for(arch: str = DEFAULT_ARCH, **fields) -> TinyMoeSpec:
    """The spec of `arch`'s family: its own defaults under the given fields (not yet validated)."""
    if arch not in FAMILIES:
        raise ValueError(f"arch={arch!r} must be one of {', '.join(ARCHS)}")
    return FAMILIES[arch](**fields)


def make_checkpoint(out_dir: str | Path, routing_from: Path | None = None, **spec_fields) -> Path:
    """Write (or reuse) the checkpoint for `spec_for(**spec_fields)` in out_dir; returns out_dir."""
    return write_checkpoint(out_dir, spec_for(**spec_fields), routing_from)


def write_checkpoint(out_dir: str | Path, spec: TinyMoeSpec, routing_from: Path | None = None) -> Path:
    """Write (or reuse) the checkpoint for `spec` in out_dir; returns out_dir. With `routing_from` (a
    routing trace), the routers are then fitted to route like it (routing.py).

    Reuses out_dir untouched when its manifest records the same spec and routing source and every file
    has the recorded size. The manifest is written last, so an interrupted run is redone.
    """
    spec.validate()
    if routing_from is not None:
        check_routing_source(spec, routing_from)
    out = Path(out_dir)
    if _manifest_matches(out, spec, routing_from):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)

    tokenizer = train_tokenizer(spec.vocab)
    vocab_size = len(tokenizer)
    config = spec.model_config(vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id)
    tensors = {name: spec.draw(name, shape) for name, shape in spec.tensor_shapes(vocab_size).items()}
    if spec.quant == "fp8":  # the bf16 source first, then the FP8 checkpoint with its quantization_config
        quantization_config = fp8.quantization_config(tensors)
        tensors, source = fp8.checkpoint_tensors(tensors)
        _save(out / fp8.SOURCE_DIR, tokenizer, config, source)
        config.quantization_config = quantization_config
    _save(out, tokenizer, config, tensors)
    for file_name, shapes in spec.side_files(vocab_size).items():  # SGLang reads every *.safetensors (no index)
        side = {name: spec.draw(name, shape) for name, shape in shapes.items()}
        _save_tensors(out / file_name, side)
        tensors |= side
    routing = {} if routing_from is None else {"routing": fit_routers(out, spec, routing_from)}

    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    manifest = {
        "format": FORMAT_VERSION,
        "spec": spec.as_manifest(),
        "files": files,
        "params": sum(t.numel() for t in tensors.values()),
        "vocab_size": vocab_size,
        "expert_bytes_per_layer": spec.expert_bytes_per_layer,
        "kv_bytes_per_token": spec.kv_bytes_per_token,
    } | spec.manifest_extras() | routing
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return out


def _save(out: Path, tokenizer, config, tensors: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    config.save_pretrained(out)
    _save_tensors(out / WEIGHTS, tensors)


def _save_tensors(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _manifest_matches(out_dir: Path, spec: TinyMoeSpec, routing_from: Path | None) -> bool:
    path = out_dir / MANIFEST
    if not path.is_file():
        return False
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION or manifest.get("spec") != spec.as_manifest():
        return False
    if manifest.get("routing", {}).get("from") != (None if routing_from is None else str(routing_from)):
        return False
    return all((out_dir / name).is_file() and (out_dir / name).stat().st_size == size
               for name, size in manifest["files"].items())


def read_manifest(out_dir: str | Path) -> dict:
    """The manifest of a checkpoint written by `make_checkpoint` (spec, sizes, params)."""
    return json.loads((Path(out_dir) / MANIFEST).read_text())
