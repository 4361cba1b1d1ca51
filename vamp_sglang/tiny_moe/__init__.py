"""Tiny deterministic random-weight MoE checkpoints that SGLang 0.5.23 serves, for tests, CI and the demo.

Why random weights: VAMP is about memory, not model quality. What matters is the geometry: expert
weights must dominate memory the way they do in real MoE models, so that offloading a few expert
groups buys thousands of KV tokens.

    python -m vamp_sglang.tiny_moe OUT_DIR [--arch ARCH] [--seed N]   (ARCH: checkpoint.FAMILIES)

One module per concern, so that a family or a quantisation is one module of its own:
- `__main__`: the CLI;
- `checkpoint`: the families (FAMILIES, what --arch offers) and writing one checkpoint, the same for all;
- `common`: `TinyMoeSpec`, what every family shares (default geometry, checks, tensor names around the
  token mixer, how a tensor is drawn, common config fields) and the hooks a family extends;
- `tokenizer`: the byte-level BPE and ChatML template every checkpoint carries;
- `routing`: `--routing-from NPZ`, routers fitted so the checkpoint routes like a real model's trace;
- `agreeing_draft`: `--agreeing-draft AGREE_DIR`, the checkpoint with an MTP draft that agrees with its target;
- `qwen3_moe`, `mixtral`, `qwen3_next`, `deepseek` (V2 and V3), `glm4_moe`, `qwen3_5_moe`, `minimax_m2`:
  one `TinyMoeSpec` subclass per family, with the family's own fields, token mixer, expert names and
  transformers config.
"""
