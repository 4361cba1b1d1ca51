"""VAMP with speculation on a hybrid model (Qwen3-Next), no server: what is served and what is refused.

The MTP draft (EAGLE, NEXTN) is served: the launcher lets it through, the state pool's per-draft-token
tensors are one row per running request (checked by name: a tensor sized by slots would need growing with
them, and is refused), and the draft's HybridLinearKVPool wrapper mirrors the size of the attention pool VAMP
laid for it. Other drafts stay refused before anything loads, naming the flag.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vamp_sglang import launch_server
from vamp_sglang.integration.memory import draft_pools
from vamp_sglang.integration.memory.kv_pool import UnsupportedPoolError
from vamp_sglang.integration.memory.state_pool import (
    UnsupportedStatePoolError,
    check_state_pool,
    per_request_rows,
)
from vamp_sglang.launch_server import ConfigError

REQUESTS, SLOTS, DRAFT_TOKENS = 8, 30, 4


def _hybrid(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_next"}')
    return ["--model-path", str(tmp_path), "--device", "cpu", "--vamp-max-offload-ratio", "0.2"]


@pytest.mark.parametrize("algorithm", ["NEXTN", "EAGLE", "nextn"])
def test_the_mtp_draft_is_served_on_a_hybrid_model(tmp_path, algorithm):
    prepared = launch_server.prepare(_hybrid(tmp_path) + ["--speculative-algorithm", algorithm,
                                                          "--speculative-eagle-topk", "1"])
    assert prepared.vamp.enabled


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_other_drafts_stay_refused_on_a_hybrid_model_naming_the_flag(tmp_path, algorithm):
    with pytest.raises(ConfigError, match="--speculative-algorithm or use NEXTN"):
        launch_server.prepare(_hybrid(tmp_path) + ["--speculative-algorithm", algorithm,
                                                   "--speculative-eagle-topk", "1"])


def test_the_mtp_draft_may_be_named_by_the_models_own_checkpoint(tmp_path):
    """SGLang turns a Qwen3-Next draft checkpoint into its MTP layer (configs/model_config.py:1134-1136):
    the target's own path, or another Qwen3-Next checkpoint, is the MTP draft."""
    flags = _hybrid(tmp_path) + ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"]
    assert launch_server.prepare(flags + ["--speculative-draft-model-path", str(tmp_path)]).vamp.enabled
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}')
    assert launch_server.prepare(flags + ["--speculative-draft-model-path", str(other)]).vamp.enabled


def test_an_eagle_head_on_a_hybrid_model_is_refused_naming_the_draft_path(tmp_path):
    """EAGLE with a separate draft (a Llama EAGLE head) is not the MTP draft VAMP serves there."""
    draft = tmp_path / "eagle"
    draft.mkdir()
    (draft / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLMEagle"]}')
    flags = _hybrid(tmp_path) + ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"]
    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):
        launch_server.prepare(flags + ["--speculative-draft-model-path", str(draft)])


def _mamba_pool(spec_rows: int | None):
    """A MambaPool as check_state_pool reads it: conv and temporal per slot, and (speculative) the
    per-draft-token tensors with `spec_rows` rows (SGLang's spec_state_size + 1)."""
    cache = SimpleNamespace(conv=[torch.zeros(2, SLOTS + 1, 6, 3)], temporal=torch.zeros(2, SLOTS + 1, 4, 5, 5))
    if spec_rows is not None:
        cache.intermediate_ssm = torch.zeros(2, spec_rows, DRAFT_TOKENS, 4, 5, 5)
        cache.intermediate_conv_window = [torch.zeros(2, spec_rows, DRAFT_TOKENS, 6, 3)]
    return SimpleNamespace(mamba_cache=cache, _raw=None, _slot_siblings=[])


def test_per_draft_token_state_one_row_per_request_needs_no_growth():
    assert per_request_rows(_mamba_pool(None).mamba_cache, REQUESTS) == []
    pool = _mamba_pool(REQUESTS + 1)
    assert per_request_rows(pool.mamba_cache, REQUESTS) == []
    check_state_pool(pool, REQUESTS)  # laid out: only conv and temporal grow with the slots


def test_per_draft_token_state_sized_by_slots_is_refused_by_name():
    pool = _mamba_pool(SLOTS + 1)
    assert per_request_rows(pool.mamba_cache, REQUESTS) == ["intermediate_ssm", "intermediate_conv_window"]
    with pytest.raises(UnsupportedStatePoolError, match="intermediate_ssm, intermediate_conv_window"):
        check_state_pool(pool, REQUESTS)


def test_a_hybrid_drafts_wrapper_mirrors_the_laid_attention_pool():
    target = SimpleNamespace(pool=object())
    inner = object()
    laid = SimpleNamespace(pool=inner, size_mirrors=[])
    wrapper = SimpleNamespace(full_kv_pool=inner)
    draft_pools.check_laid(wrapper, target, [laid])
    assert laid.size_mirrors == [wrapper]
    with pytest.raises(UnsupportedPoolError, match="not built through"):
        draft_pools.check_laid(SimpleNamespace(full_kv_pool=object()), target, [laid])
