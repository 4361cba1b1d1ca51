"""Tiny drafts: the DeepSeek-V3 MTP layer (`--arch deepseek_v3`) SGLang's NextN loader reads, and Qwen3-Next's
(`--arch qwen3_next`) that SGLang's Qwen3NextForCausalLMMTP loads, each in its own file, so transformers still
loads the main file with no unexpected key (the other families write no draft); and the EAGLE3 draft of a tiny
Qwen3-MoE (`--eagle3-draft`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from vamp_sglang.cpu import cpu_environment
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint, read_manifest
from vamp_sglang.tiny_moe.deepseek import MTP_WEIGHTS

SMALL = {"layers": 3, "experts": 16, "hidden": 64, "intermediate": 32, "vocab": 512}


def names(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v3"), arch="deepseek_v3", **SMALL)


def test_mtp_layer_is_the_nextn_layout(v3):
    """layer `layers` holds the four NextN tensors plus a whole MoE decoder layer (SGLang maps them to
    `model.*` and `model.decoder.*`, deepseek_weight_loader.py:319-334); embeddings and head are the
    target's."""
    config = json.loads((v3 / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    mtp = names(v3 / MTP_WEIGHTS)
    assert {f"model.layers.3.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")} <= mtp
    first_moe = {n.replace("model.layers.1.", "model.layers.3.") for n in names(v3 / "model.safetensors")
                 if n.startswith("model.layers.1.")}
    assert mtp - first_moe == {f"model.layers.3.{n}.weight" for n in ("enorm", "hnorm", "eh_proj",
                                                                       "shared_head.norm")}
    assert first_moe <= mtp and sum(".mlp.experts." in n for n in mtp) == 16 * 3
    assert not any(n.startswith("model.layers.3.") for n in names(v3 / "model.safetensors"))
    with safe_open(str(v3 / MTP_WEIGHTS), "pt") as f:
        assert tuple(f.get_slice("model.layers.3.eh_proj.weight").get_shape()) == (64, 128)
        draft_q = f.get_tensor("model.layers.3.self_attn.q_a_proj.weight")
    with safe_open(str(v3 / "model.safetensors"), "pt") as f:
        assert not draft_q.equal(f.get_tensor("model.layers.1.self_attn.q_a_proj.weight"))  # its own draws


def test_manifest_records_the_mtp_file(v3):
    manifest = read_manifest(v3)
    assert manifest["spec"]["mtp_layers"] == 1 and MTP_WEIGHTS in manifest["files"]


NEXT_SMALL = SMALL | {"layers": 4, "kv_heads": 2, "shared_intermediate": 32}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("next"), arch="qwen3_next", **NEXT_SMALL)


def test_qwen3_next_mtp_layer_is_one_attention_layer_under_mtp(qwen3_next):
    """`mtp.layers.0` carries the names of the target's first full-attention layer (layer 3 of 4, the only
    kind the MTP layer is, models/qwen3_next_mtp.py:66-74), with its own draws; `mtp.fc`, the two pre-fc norms
    and `mtp.norm` surround it; nothing named `mtp.` is in the main file (SGLang's target skips them anyway)."""
    mtp = names(qwen3_next / MTP_WEIGHTS)
    attention = {n.replace("model.layers.3.", "mtp.layers.0.") for n in names(qwen3_next / "model.safetensors")
                 if n.startswith("model.layers.3.")}
    extra = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}
    assert mtp == attention | extra and not any("linear_attn" in n for n in mtp)
    assert not any(n.startswith("mtp.") for n in names(qwen3_next / "model.safetensors"))
    with safe_open(str(qwen3_next / MTP_WEIGHTS), "pt") as f:
        assert tuple(f.get_slice("mtp.fc.weight").get_shape()) == (64, 128)
        assert f.get_tensor("mtp.norm.weight").abs().sum() == 0  # (1 + weight) norms: neutral at 0
        draft_q = f.get_tensor("mtp.layers.0.self_attn.q_proj.weight")
    with safe_open(str(qwen3_next / "model.safetensors"), "pt") as f:
        assert not draft_q.equal(f.get_tensor("model.layers.3.self_attn.q_proj.weight"))
    manifest = read_manifest(qwen3_next)
    assert manifest["spec"]["mtp_layers"] == 1 and MTP_WEIGHTS in manifest["files"]


# SGLang builds the draft as it does for NEXTN (ModelConfig with is_draft_model, configs/model_config.py:1134-1136)
# and loads mtp.safetensors one tensor at a time: each must land in a parameter, and every parameter but the
# embedding and head (the target's, shared by set_embed_and_head) must be loaded.
LOAD = """
import sys
from safetensors import safe_open
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.bootstrap import init_parallel_runtime
from sglang.srt.models.qwen3_next import Qwen3NextForCausalLM
from sglang.srt.models.qwen3_next_mtp import Qwen3NextForCausalLMMTP
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs
path, port = sys.argv[1], int(sys.argv[2])
args = ServerArgs(model_path=path, device="cpu", attention_backend="torch_native", dtype="float32",
                  speculative_algorithm="NEXTN", speculative_num_steps=1, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=2, disable_overlap_schedule=True)
publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
init_parallel_runtime(server_args=args, device="cpu", dist_port=port)
config = ModelConfig.from_server_args(args, model_path=path, is_draft_model=True)
assert config.hf_config.architectures == ["Qwen3NextForCausalLMMTP"], config.hf_config.architectures
model = Qwen3NextForCausalLMMTP(config.hf_config)
params, loaded, unexpected = {n for n, _ in model.named_parameters()}, set(), []
with safe_open(path + "/mtp.safetensors", "pt") as f:
    for name in f.keys():
        got = Qwen3NextForCausalLM.load_weights(model, [(name, f.get_tensor(name))], is_mtp=True)
        loaded |= got & params
        unexpected += [] if got & params else [name]
print(sorted(unexpected), sorted(params - loaded))
"""


@pytest.mark.long
def test_sglangs_qwen3_next_mtp_loads_every_tensor(qwen3_next):
    """About 10 s (an SGLang import and a one-rank gloo group in a fresh interpreter), hence make test-long."""
    from eval.servers import free_port

    env = os.environ | cpu_environment()
    proc = subprocess.run([sys.executable, "-c", LOAD, str(qwen3_next), str(free_port())], capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[] ['lm_head.weight', 'model.embed_tokens.weight']"


@pytest.mark.parametrize("fields", [{"arch": "deepseek_v2"}, {"arch": "qwen3_moe"}, {"arch": "qwen3_5_moe"}])
def test_other_families_write_no_draft(tmp_path, fields):
    small = {"deepseek_v2": SMALL, "qwen3_moe": SMALL | {"kv_heads": 2}, "qwen3_5_moe": NEXT_SMALL}[fields["arch"]]
    out = make_checkpoint(tmp_path, **fields, **small)
    assert not (out / MTP_WEIGHTS).exists() and "mtp_layers" not in read_manifest(out)["spec"]


def test_eagle3_draft_is_the_llama_eagle3_layout(tmp_path, capsys):
    """`--eagle3-draft`: one Llama layer reading [embed; fc(3 target hidden states)], the names SGLang's
    LlamaForCausalLMEagle3 loads (`midlayer` -> `layers.0`), three distinct target layers to capture."""
    from vamp_sglang.tiny_moe.__main__ import main

    target, draft = tmp_path / "target", tmp_path / "draft"
    main([str(target), "--arch", "qwen3_moe", "--layers", "6", "--experts", "8", "--hidden", "64",
          "--intermediate", "16", "--eagle3-draft", str(draft)])
    assert "qwen3_moe" in capsys.readouterr().out
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    layers = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert len(set(layers)) == 3 and max(layers) + 1 < 6  # SGLang captures layer id + 1
    assert config["draft_vocab_size"] == config["vocab_size"] == read_manifest(target)["vocab_size"]
    weights = draft / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names(weights)}
    assert shapes["fc.weight"] == (64, 3 * 64)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 64, 2 * 64)  # reads [embed; fc output]
    assert shapes["lm_head.weight"] == (config["vocab_size"], 64) and "embed_tokens.weight" not in shapes
    assert (draft / "tokenizer.json").is_file() and not (draft / "vamp_tiny_moe.json").exists()


def test_eagle3_draft_needs_a_qwen3_moe_target(tmp_path):
    from vamp_sglang.tiny_moe.eagle3 import write_eagle3_draft

    target = make_checkpoint(tmp_path / "v2", arch="deepseek_v2", **SMALL)
    with pytest.raises(ValueError, match="qwen3_moe"):
        write_eagle3_draft(target, tmp_path / "draft")
