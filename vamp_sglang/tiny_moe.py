"""A deterministic random-weight MoE checkpoint that SGLang 0.5.23 serves, for tests, CI and the demo.

Why random weights: VAMP is about memory, not model quality. What matters is the geometry: expert
weights must dominate memory the way they do in real MoE models, so that offloading a few expert
groups buys thousands of KV tokens. The default (6 layers, 128 experts, hidden 256, expert
intermediate 256, float32) holds 96 MiB of experts per layer against 6 KiB of KV per token
(2 KV heads x head_dim 64), so 25% of the five eligible layers is about 20k tokens.

`--arch qwen3_next` is SGLang's Qwen3-Next (the paper's model) scaled down: 8 layers, full attention
every 4th (layers 3 and 7, query-gated, partial RoPE), Gated DeltaNet linear attention in the others
with the real model's head ratio (2 key heads, 4 value heads, head dims 64, conv kernel 4; the real one
has 16/32 heads of 128), the same 128 experts of 256 as the default plus a shared expert of 256 behind
a sigmoid gate. Experts hold 96 MiB per layer; KV is 2 KiB per token (two attention layers), and each
request's linear-attention state is 6 layers x (64 KiB recurrent + 6 KiB conv), float32.

The checkpoint is written in the Hugging Face hub layout (one tensor per expert projection), which is
what both transformers' and SGLang's loaders expect, whatever fused layout they build in memory.
Every tensor is drawn from its own generator seeded by (seed, tensor name), so the bytes do not
depend on the order of creation; the safetensors file is byte-identical for a given seed.
The tokenizer is a byte-level BPE trained here on a built-in corpus (no download), wrapped in
`PreTrainedTokenizerFast` with a ChatML chat template.

    python -m vamp_sglang.tiny_moe OUT_DIR [--arch qwen3_moe|mixtral|qwen3_next] [--seed N]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ARCHS = ("qwen3_moe", "mixtral", "qwen3_next")
HYBRID_FIELDS = ("full_attention_interval", "linear_key_heads", "linear_value_heads", "linear_head_dim",
                 "conv_kernel", "shared_intermediate")  # qwen3_next only; left out of other archs' manifests
ARCH_DEFAULTS = {"qwen3_next": {"layers": 8}}  # where an arch's tiny model differs from the default
MANIFEST = "vamp_tiny_moe.json"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LOGIT_STD = 4.0  # spread of the random logits: peaked enough that greedy decoding is not flat
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class TinyMoeSpec:
    """Geometry and seed of a tiny MoE checkpoint; equal specs give byte-identical weights."""

    arch: str = "qwen3_moe"
    seed: int = 0
    layers: int = 6
    experts: int = 128
    top_k: int = 2
    hidden: int = 256
    intermediate: int = 256  # per-expert FFN width
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 2048  # BPE target; the model's vocab is the tokenizer's actual size
    max_positions: int = 16384
    full_attention_interval: int = 4  # qwen3_next: layer i has full attention iff (i + 1) % interval == 0
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_head_dim: int = 64  # key and value head dim of the linear-attention layers
    conv_kernel: int = 4
    shared_intermediate: int = 256  # the shared expert's FFN width

    @classmethod
    def for_arch(cls, arch: str = "qwen3_moe", **fields) -> TinyMoeSpec:
        """The spec with `arch`'s own defaults (ARCH_DEFAULTS) under the given fields."""
        return cls(arch=arch, **(ARCH_DEFAULTS.get(arch, {}) | fields))

    @property
    def is_hybrid(self) -> bool:
        return self.arch == "qwen3_next"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with a KV cache (all, or every full_attention_interval-th for qwen3_next)."""
        if not self.is_hybrid:
            return tuple(range(self.layers))
        return tuple(i for i in range(self.layers) if (i + 1) % self.full_attention_interval == 0)

    def as_manifest(self) -> dict:
        """The spec as the manifest records it (other archs' manifests keep their original fields)."""
        fields = dataclasses.asdict(self)
        return fields if self.is_hybrid else {k: v for k, v in fields.items() if k not in HYBRID_FIELDS}

    def validate(self) -> TinyMoeSpec:
        s = self
        checks = [
            (s.arch in ARCHS, f"arch={s.arch!r} must be one of {', '.join(ARCHS)}"),
            (s.seed >= 0, f"seed={s.seed} must be >= 0"),
            (s.layers >= 1, f"layers={s.layers} must be >= 1"),
            (s.experts >= 1, f"experts={s.experts} must be >= 1"),
            (1 <= s.top_k <= s.experts, f"top_k={s.top_k} must be in [1, experts={s.experts}]"),
            (s.hidden >= 8, f"hidden={s.hidden} must be >= 8"),
            (s.intermediate >= 1, f"intermediate={s.intermediate} must be >= 1"),
            (s.kv_heads >= 1, f"kv_heads={s.kv_heads} must be >= 1"),
            (s.heads >= 1 and s.kv_heads >= 1 and s.heads % s.kv_heads == 0,
             f"heads={s.heads} must be a positive multiple of kv_heads={s.kv_heads}"),
            (s.head_dim >= 2 and s.head_dim % 2 == 0, f"head_dim={s.head_dim} must be even and >= 2"),
            (s.arch != "mixtral" or s.heads * s.head_dim == s.hidden,
             (f"heads*head_dim={s.heads * s.head_dim} must equal hidden={s.hidden} for mixtral"
              " (SGLang derives head_dim from hidden)")),
            (s.vocab >= 512, f"vocab={s.vocab} must be >= 512"),
            (s.max_positions >= 128, f"max_positions={s.max_positions} must be >= 128"),
        ]
        if s.is_hybrid:
            checks += [
                (1 <= s.full_attention_interval <= s.layers,
                 f"full_attention_interval={s.full_attention_interval} must be in [1, layers={s.layers}]"),
                (s.linear_key_heads >= 1 and s.linear_value_heads % s.linear_key_heads == 0,
                 f"linear_value_heads={s.linear_value_heads} must be a multiple of linear_key_heads"),
                (s.linear_head_dim >= 2, f"linear_head_dim={s.linear_head_dim} must be >= 2"),
                (s.conv_kernel >= 2, f"conv_kernel={s.conv_kernel} must be >= 2"),
                (s.shared_intermediate >= 1, f"shared_intermediate={s.shared_intermediate} must be >= 1"),
            ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self

    @property
    def expert_bytes_per_layer(self) -> int:
        """gate, up and down projections of every expert in one layer, float32."""
        return self.experts * 3 * self.hidden * self.intermediate * FLOAT32_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every attention layer for one token, float32 (what one KV pool slot costs)."""
        return len(self.attention_layers) * 2 * self.kv_heads * self.head_dim * FLOAT32_BYTES


    @property
    def linear_state_bytes(self) -> int:
        """One request's linear-attention state (recurrent [HV, V, K] and conv [D, W-1] per layer), float32."""
        if not self.is_hybrid:
            return 0
        heads_v, dim = self.linear_value_heads, self.linear_head_dim
        conv_dim = (2 * self.linear_key_heads + heads_v) * dim
        per_layer = heads_v * dim * dim + conv_dim * (self.conv_kernel - 1)
        return (self.layers - len(self.attention_layers)) * per_layer * FLOAT32_BYTES


def _qwen3_next_layer_shapes(spec: TinyMoeSpec, p: str, attention: bool) -> dict[str, tuple[int, ...]]:
    """One Qwen3-Next layer's token mixer and shared expert, in the hub layout SGLang's loader maps."""
    h, d = spec.hidden, spec.head_dim
    if attention:  # q_proj carries the output gate next to each head's query
        return {
            f"{p}.self_attn.q_proj.weight": (spec.heads * d * 2, h),
            f"{p}.self_attn.k_proj.weight": (spec.kv_heads * d, h),
            f"{p}.self_attn.v_proj.weight": (spec.kv_heads * d, h),
            f"{p}.self_attn.o_proj.weight": (h, spec.heads * d),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
        }
    key = spec.linear_key_heads * spec.linear_head_dim
    value = spec.linear_value_heads * spec.linear_head_dim
    return {
        f"{p}.linear_attn.in_proj_qkvz.weight": (2 * key + 2 * value, h),
        f"{p}.linear_attn.in_proj_ba.weight": (2 * spec.linear_value_heads, h),
        f"{p}.linear_attn.conv1d.weight": (2 * key + value, 1, spec.conv_kernel),
        f"{p}.linear_attn.dt_bias": (spec.linear_value_heads,),
        f"{p}.linear_attn.A_log": (spec.linear_value_heads,),
        f"{p}.linear_attn.norm.weight": (spec.linear_head_dim,),
        f"{p}.linear_attn.out_proj.weight": (h, value),
    }


def tensor_shapes(spec: TinyMoeSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint in hub layout, name -> shape."""
    h, i = spec.hidden, spec.intermediate
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab_size, h),
    }
    moe = "block_sparse_moe" if spec.arch == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if spec.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for layer in range(spec.layers):
        p = f"model.layers.{layer}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        if spec.is_hybrid:
            shapes |= _qwen3_next_layer_shapes(spec, p, layer in spec.attention_layers)
            shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
            for proj, shape in (("gate_proj", (spec.shared_intermediate, h)),
                                ("up_proj", (spec.shared_intermediate, h)),
                                ("down_proj", (h, spec.shared_intermediate))):
                shapes[f"{p}.mlp.shared_expert.{proj}.weight"] = shape
        else:
            shapes |= _attention_shapes(spec, p)
        shapes[f"{p}.{moe}.gate.weight"] = (spec.experts, h)
        for e in range(spec.experts):
            shapes[f"{p}.{moe}.experts.{e}.{names[0]}.weight"] = (i, h)
            shapes[f"{p}.{moe}.experts.{e}.{names[1]}.weight"] = (i, h)
            shapes[f"{p}.{moe}.experts.{e}.{names[2]}.weight"] = (h, i)
    return shapes


def _attention_shapes(spec: TinyMoeSpec, p: str) -> dict[str, tuple[int, ...]]:
    """The attention of a qwen3_moe or mixtral layer."""
    h, d = spec.hidden, spec.head_dim
    shapes = {
        f"{p}.self_attn.q_proj.weight": (spec.heads * d, h),
        f"{p}.self_attn.k_proj.weight": (spec.kv_heads * d, h),
        f"{p}.self_attn.v_proj.weight": (spec.kv_heads * d, h),
        f"{p}.self_attn.o_proj.weight": (h, spec.heads * d),
    }
    if spec.arch == "qwen3_moe":
        shapes[f"{p}.self_attn.q_norm.weight"] = (d,)
        shapes[f"{p}.self_attn.k_norm.weight"] = (d,)
    return shapes


# Qwen3-Next's RMSNorms scale by (1 + weight) (SGLang's GemmaRMSNorm), so their neutral weight is 0;
# the gated norm inside linear attention scales by weight.
_UNIT_NORM_AT_ZERO = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
                      "q_norm.weight", "k_norm.weight")
A_RANGE = (0.05, 1.0)  # qwen3_next decay rate exp(A_log): state kept over a few tokens, not forgotten at once


def _draw(seed: int, name: str, shape: tuple[int, ...], hybrid: bool = False) -> torch.Tensor:
    """One tensor from a generator keyed by (seed, name): independent of creation order."""
    if name.endswith("norm.weight"):
        zero = hybrid and name.endswith(_UNIT_NORM_AT_ZERO)
        return (torch.zeros if zero else torch.ones)(shape, dtype=torch.float32)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=torch.float32)  # as transformers initialises it
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(key & (2**63 - 1))
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(*A_RANGE, generator=generator).log()
    if name == "model.embed_tokens.weight":
        std = 1.0
    elif name == "lm_head.weight":
        std = LOGIT_STD / math.sqrt(shape[1])  # the final RMSNorm gives unit-RMS inputs
    else:
        std = 1.0 / math.sqrt(math.prod(shape[1:]))  # keep every projection's output near unit scale
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def _corpus() -> list[str]:
    """A fixed English corpus, repeated in a fixed order: enough merges for a ~2k vocabulary."""
    words = _CORPUS.split()
    lines = [" ".join(words[k:k + 12]) for k in range(0, len(words), 12)]
    numbers = [" ".join(str(n * 7 + k) for k in range(10)) for n in range(0, 1000, 10)]
    return lines + numbers + ["User: hello! Assistant: Hi, how can I help you today?"] * 4


def train_tokenizer(vocab: int):
    """Byte-level BPE trained on the built-in corpus, wrapped for transformers with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=1 << 20,
    )


def model_config(spec: TinyMoeSpec, vocab_size: int, eos_id: int, pad_id: int):
    """The transformers config that both transformers and SGLang read."""
    from transformers import MixtralConfig, Qwen3MoeConfig, Qwen3NextConfig

    common = {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "num_experts_per_tok": spec.top_k,
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }
    if spec.arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, num_experts=spec.experts, moe_intermediate_size=spec.intermediate,
            intermediate_size=spec.intermediate, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
    elif spec.is_hybrid:
        config = Qwen3NextConfig(
            **common, num_experts=spec.experts, moe_intermediate_size=spec.intermediate,
            intermediate_size=spec.intermediate, shared_expert_intermediate_size=spec.shared_intermediate,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            layer_types=["full_attention" if i in spec.attention_layers else "linear_attention"
                         for i in range(spec.layers)],
            linear_num_key_heads=spec.linear_key_heads, linear_num_value_heads=spec.linear_value_heads,
            linear_key_head_dim=spec.linear_head_dim, linear_value_head_dim=spec.linear_head_dim,
            linear_conv_kernel_dim=spec.conv_kernel, partial_rotary_factor=0.25,
        )
        config.architectures = ["Qwen3NextForCausalLM"]
        # SGLang's own Qwen3NextConfig needs these top-level keys, which transformers 5 does not save.
        config.full_attention_interval = spec.full_attention_interval
        config.rope_theta = config.rope_parameters["rope_theta"]
    else:
        config = MixtralConfig(**common, num_local_experts=spec.experts, intermediate_size=spec.intermediate)
        config.architectures = ["MixtralForCausalLM"]
    return config


def _manifest_matches(out_dir: Path, spec: TinyMoeSpec) -> bool:
    path = out_dir / MANIFEST
    if not path.is_file():
        return False
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION or manifest.get("spec") != spec.as_manifest():
        return False
    return all((out_dir / name).is_file() and (out_dir / name).stat().st_size == size
               for name, size in manifest["files"].items())


def make_checkpoint(out_dir: str | Path, **spec_fields) -> Path:
    """Write (or reuse) the checkpoint for `TinyMoeSpec.for_arch(**spec_fields)` in out_dir; returns out_dir.

    Reuses out_dir untouched when its manifest records the same spec and every file has the
    recorded size. The manifest is written last, so an interrupted run is redone.
    """
    from safetensors.torch import save_file

    spec = TinyMoeSpec.for_arch(**spec_fields).validate()
    out = Path(out_dir)
    if _manifest_matches(out, spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)

    tokenizer = train_tokenizer(spec.vocab)
    tokenizer.save_pretrained(out)
    vocab_size = len(tokenizer)
    config = model_config(spec, vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.save_pretrained(out)
    tensors = {name: _draw(spec.seed, name, shape, spec.is_hybrid) for name, shape in tensor_shapes(spec, vocab_size).items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})

    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {
        "format": FORMAT_VERSION,
        "spec": spec.as_manifest(),
        "files": files,
        "params": sum(t.numel() for t in tensors.values()),
        "vocab_size": vocab_size,
        "expert_bytes_per_layer": spec.expert_bytes_per_layer,
        "kv_bytes_per_token": spec.kv_bytes_per_token,
    }
    if spec.is_hybrid:
        manifest["linear_state_bytes"] = spec.linear_state_bytes
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return out


def read_manifest(out_dir: str | Path) -> dict:
    """The manifest of a checkpoint written by `make_checkpoint` (spec, sizes, params)."""
    return json.loads((Path(out_dir) / MANIFEST).read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vamp_sglang.tiny_moe",
                                     description=__doc__.splitlines()[0])
    defaults = TinyMoeSpec()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default=defaults.arch)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--layers", type=int, default=None, help=f"default {defaults.layers} (qwen3_next: 8)")
    parser.add_argument("--experts", type=int, default=defaults.experts)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--intermediate", type=int, default=defaults.intermediate)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    args = parser.parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k != "out_dir" and v is not None}
    start_s = time.perf_counter()
    try:
        out = make_checkpoint(args.out_dir, **fields)
    except ValueError as exc:
        parser.error(str(exc))
    manifest = read_manifest(out)
    expert_bytes = manifest["expert_bytes_per_layer"]
    print(
        f"{out}: {manifest['spec']['arch']} seed={manifest['spec']['seed']} "
        f"params={manifest['params'] / 1e6:.1f}M vocab={manifest['vocab_size']} "
        f"expert_bytes_per_layer={expert_bytes} ({expert_bytes / 2**20:.1f} MiB) "
        f"kv_bytes_per_token={manifest['kv_bytes_per_token']} "
        + (f"linear_state_bytes={manifest['linear_state_bytes']} " if "linear_state_bytes" in manifest else "")
        + f"({time.perf_counter() - start_s:.1f}s)"
    )


_CORPUS = """
Once upon a time, in a small village between the mountains and the sea, there lived a baker who rose
every morning before the sun. She mixed flour, water, salt and yeast, and while the dough was rising she
walked to the harbour to watch the fishing boats come home. The fishermen waved to her, and she waved
back, and the gulls circled above them all, crying for bread. Her bakery was famous for its brown loaves,
its sweet cinnamon rolls, and the honey cakes that children bought on their way to school.
One winter the snow fell for seven days without stopping. The roads were closed, the boats stayed in
the harbour, and nobody could reach the market in the next town. The baker looked at her shelves and
counted what was left: three sacks of flour, a jar of honey, a basket of apples and a little butter.
She decided to bake for everyone, rich or poor, and to ask nothing in return until the spring.
Computers work in a similar way. A server receives requests from many users, keeps a queue of work,
and decides every moment which request should run next. Memory is limited, so the scheduler must choose
what to keep and what to throw away. When a conversation continues, the model can reuse the attention
keys and values it computed for earlier turns, which saves time. When memory runs out, the server may
evict old entries, pause a request and compute it again later, or move rarely used weights elsewhere.
Each choice has a cost, measured in milliseconds, and a good policy compares those costs before acting.
The library opened at nine o'clock on weekdays and at ten on Saturday. Students came to study
mathematics, history, chemistry, music and languages. The librarian knew where every book was kept:
novels on the second floor, maps and atlases near the window, dictionaries beside the reading tables,
and old newspapers in the basement, where the air smelled of paper and dust.
Good morning! How are you today? I am fine, thank you. Could you please tell me the way to the station?
Turn left at the corner, walk past the church, and you will see it on your right. It takes about ten
minutes on foot. Would you like a cup of tea or coffee? Yes, please, with milk and no sugar.
What is the weather like tomorrow? The forecast says it will be cloudy in the morning, with rain in the
afternoon and strong wind from the north. Remember to bring an umbrella and a warm jacket.
Science begins with questions. Why is the sky blue? Why do leaves change colour in autumn? How far away
is the moon, and how hot is the centre of the earth? Scientists answer such questions by observing
carefully, measuring, building models and testing predictions against new experiments. A theory that
survives many tests becomes trusted, but it can always be improved when better evidence appears.
The river flows from the glacier through forests, farms and cities until it reaches the ocean. Along
the way it carries sand, stones and fallen branches. Trout and salmon swim upstream each year, and
bears wait for them in the shallow water. In summer, families camp on the banks, light small fires,
cook sausages and tell stories under the stars until the children fall asleep.
An engineer should write clear code, test it honestly, and measure before optimising. Small functions
with good names are easier to read than long ones. Every error message should say what went wrong and
how to fix it. Documentation explains why a design was chosen, not only what the code does.
"""

if __name__ == "__main__":
    main()
