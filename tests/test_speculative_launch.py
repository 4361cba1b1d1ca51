"""An EAGLE/EAGLE3 draft whose KV row differs from the target's is refused by the launcher (issue 46).

VAMP grows the draft's KV buffers by the target's row count (integration/memory/draft_pools.py), which needs
the draft's row (KV heads on one attention-TP rank x head size, or MLA's latent) to equal the target's. The
scheduler-start guard checks the pools SGLang built; the launcher checks what the two config.json files say,
so a local draft that cannot grow is refused in a second, naming the flag, before SGLang loads. A draft it
cannot read (a hub name) is left to the guard.
"""

import json
import subprocess
import sys
import time

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError

FLAG = "--speculative-draft-model-path"
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
             "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 94}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
            "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "num_hidden_layers": 61, "num_nextn_predict_layers": 1}
EAGLE3 = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
          "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 1}


def _dir(tmp_path, name, config):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _argv(root, target, draft=None, *flags, ratio="0.2", draft_flag=FLAG):
    """The launcher's argv: the target's and the draft's config.json under `root` (a str draft is passed as is)."""
    root.mkdir(exist_ok=True)
    argv = ["--model-path", _dir(root, "target", target), "--device", "cpu", "--speculative-algorithm",
            "EAGLE3" if draft else "EAGLE", "--speculative-eagle-topk", "1", "--vamp-max-offload-ratio", ratio]
    if draft is not None:
        argv += [draft_flag, draft if isinstance(draft, str) else _dir(root, "draft", draft)]
    return argv + list(flags)


@pytest.mark.parametrize("draft, flags, why", [
    ({**EAGLE3, "num_key_value_heads": 8}, [], "8 KV heads x 128"),
    ({**EAGLE3, "num_key_value_heads": 8}, ["--tp-size", "4"], "2 KV heads x 128"),
    ({**EAGLE3, "head_dim": 64}, [], "4 KV heads x 64"),
    ({k: v for k, v in EAGLE3.items() if k != "head_dim"} | {"num_attention_heads": 16}, [], "4 KV heads x 256"),
    ({**EAGLE3, "num_key_value_heads": 8}, ["--tp-size", "8", "--dp-size", "2", "--enable-dp-attention"],
     "2 KV heads x 128"),  # attention-TP 4: the target holds one KV head a rank, the draft two
], ids=["heads", "heads-tp4", "head-dim", "head-dim-from-hidden", "dp-attention"])
def test_a_draft_with_another_kv_row_is_refused_naming_the_flag(tmp_path, draft, flags, why):
    with pytest.raises(ConfigError) as err:
        launch_server.prepare(_argv(tmp_path, QWEN3_MOE, draft, *flags))
    assert FLAG in str(err.value) and why in str(err.value)


def test_an_mha_draft_on_an_mla_target_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=f"{FLAG}.*MLA latent of 576"):
        launch_server.prepare(_argv(tmp_path, DEEPSEEK, EAGLE3))


@pytest.mark.parametrize("target, draft, flags", [
    (QWEN3_MOE, EAGLE3, []),
    (QWEN3_MOE, {**EAGLE3, "num_key_value_heads": 8}, ["--tp-size", "8"]),  # one KV head per rank in both
    (DEEPSEEK, None, []),  # the MTP layer: the target's own attention
    (QWEN3_MOE, "lmsys/Qwen3-235B-A22B-EAGLE3", []),  # a hub name: the scheduler-start guard decides
], ids=["equal", "replicated-heads", "mtp", "hub-draft"])
def test_a_draft_with_the_targets_row_or_one_the_launcher_cannot_read_is_served(tmp_path, target, draft, flags):
    assert launch_server.prepare(_argv(tmp_path, target, draft, *flags)).vamp.enabled


def test_vamp_off_serves_any_draft_and_sglangs_alias_of_the_flag_is_read(tmp_path):
    wide = {**EAGLE3, "num_key_value_heads": 8}
    assert not launch_server.prepare(_argv(tmp_path / "off", QWEN3_MOE, wide, ratio="0")).vamp.enabled
    with pytest.raises(ConfigError, match=FLAG):
        launch_server.prepare(_argv(tmp_path / "alias", QWEN3_MOE, wide, draft_flag="--speculative-draft-model"))


def test_the_refusal_exits_2_within_a_second(tmp_path):
    argv = _argv(tmp_path, QWEN3_MOE, {**EAGLE3, "num_key_value_heads": 8})
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", *argv], check=False,
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2 and FLAG in proc.stderr, proc.stderr
    assert elapsed < 1.0, f"refusal took {elapsed:.2f} s"
