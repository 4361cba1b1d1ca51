"""Qwen3_5MoeForConditionalGeneration, the class the published Qwen3.5/3.6 checkpoints name (issue 47).

`write_wrapper` puts the tiny Qwen3.5 text checkpoint's weights in that layout (text_config plus a one-block
vision tower, the language model under `model.language_model.`). Two servers on it through our launcher, one at
a time, with the requests and pools of tests/test_qwen3_5_moe_server.py, SGLang building the vision tower and
processor as it does for the published checkpoints. Checked:
- ratio 0's greedy tokens (text-only requests) equal transformers' Qwen3_5MoeForCausalLM on the text checkpoint
  with the same weights;
- VAMP-20 grew both the full-attention KV pool and the Gated DeltaNet state pool from expert memory, and gave
  ratio 0's greedy tokens.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tests.test_new_families_server import test_reference_run_equals_transformers as _equals_transformers
from tests.test_qwen3_5_moe_server import MODEL, _serve
from tests.test_qwen3_5_moe_server import test_vamp20_grew_both_pools_from_expert_memory as _grew_both_pools
from vamp_sglang.tiny_moe.checkpoint import make_checkpoint
from vamp_sglang.tiny_moe.qwen3_5_moe import WRAPPER_ARCHITECTURE, write_wrapper

pytestmark = [pytest.mark.server, pytest.mark.long]  # make test-long (two servers)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    text = make_checkpoint(MODEL, arch="qwen3_5_moe")
    wrapper = write_wrapper(text, tmp_path_factory.mktemp("wrapper"))
    logs = tmp_path_factory.mktemp("logs")
    return {"model": text, "wrapper": wrapper} | {name: _serve(wrapper, logs, name) for name in ("ratio0-large",
                                                                                                 "vamp20")}


def test_wrapper_layout(runs):
    config = json.loads((runs["wrapper"] / "config.json").read_text())
    assert config["architectures"] == [WRAPPER_ARCHITECTURE] and config["model_type"] == "qwen3_5_moe"
    assert config["text_config"]["model_type"] == "qwen3_5_moe_text" and config["vision_config"]["depth"] == 1
    with safe_open(runs["wrapper"] / "model.safetensors", "pt") as wrapped, \
            safe_open(runs["model"] / "model.safetensors", "pt") as text:
        names, text_names = set(wrapped.keys()), set(text.keys())
        assert {n for n in names if not n.startswith("model.visual.")} == {
            n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n for n in text_names}
        assert any(n.startswith("model.visual.blocks.0.") for n in names)


def test_ratio0_text_tokens_equal_the_text_checkpoint(runs):
    _equals_transformers(runs)


def test_vamp20_grew_both_pools_from_expert_memory(runs):
    _grew_both_pools(runs)


def test_vamp20_greedy_outputs_equal_ratio0(runs):
    assert [s["context"] for s in runs["vamp20"]["sessions"]] == [
        s["context"] for s in runs["ratio0-large"]["sessions"]]
