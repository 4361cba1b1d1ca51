"""The capacity planner with speculative decoding (issue 46): the draft layer's KV rows grow with the target's,
and its weights (DeepSeek's MTP layer with its 256 resident routed experts) leave less for the start-up pool.

SGLang 0.5.23 sizes the shared pool with the draft's layers in the cell (model_executor/pool_configurator.py:
259-314: cell x (1 + draft layers / target KV layers)) and counts the draft's weights, loaded before the pool
is sized (managers/scheduler.py:1128-1137, mem_cache/kv_cache_configurator.py:3042).
"""

import argparse
import json

import pytest
from test_capacity import _refused, _run

from vamp_sglang.capacity.draft import DRAFTS
from vamp_sglang.capacity.models import BUILTIN
from vamp_sglang.capacity.plan import GIB
from vamp_sglang.memory.geometry import geometry_from_config
from vamp_sglang.memory.layout import kv_pages_per_buffer, kv_rows_for_bytes

DEEPSEEK_TP8 = ["--model", "deepseek-v3", "--gpu-mem-gib", "140", "--tp", "8", "--ratios", "0.05,0.1", "--json"]
QWEN_TP4 = ["--model", "qwen3-235b-a22b", "--gpu-mem-gib", "140", "--tp", "4", "--ratios", "0.1,0.2", "--json"]
NEXT_TP4 = ["--model", "qwen3-next-80b-a3b", "--gpu-mem-gib", "140", "--tp", "4", "--ratios", "0.1,0.2", "--json"]
EAGLE3 = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "qwen3-235b-a22b-eagle3"]
PAGE = 2 << 20
# Qwen3-Next-80B's linear-attention state per request at attention-TP 4 (36 Gated DeltaNet layers): a bfloat16
# conv window of 3 over q, k, v and a float32 recurrent state of 8 value heads x 128 x 128 (checked against
# SGLang's mamba_cache_per_req in test_the_state_bytes_per_request_are_sglangs_mamba_cache_per_req)
NEXT_STATE_PER_REQ_TP4 = 36 * ((32 * 128 + 2 * 16 * 128) // 4 * 3 * 2 + 32 // 4 * 128 * 128 * 4)


def _gain(report, key):
    return report["ratios"][key]["kv_pool_tokens"] - report["baseline"]["kv_pool_tokens"]


def test_deepseek_v3_mtp_adds_one_mla_layer_of_kv_and_its_resident_experts_to_the_weights(capsys):
    """NEXTN on DeepSeek-V3 at TP8: the MTP layer is one more MLA layer (576 x 2 bytes a token, 62 latent buffers
    instead of 61) and one more MoE layer whose 256 routed experts (an eighth of each on every rank) stay
    resident; the pool at ratio 0 holds (budget - every weight) / 71,424 bytes."""
    plain = _run(DEEPSEEK_TP8, capsys)
    spec = _run([*DEEPSEEK_TP8, "--speculative-algorithm", "NEXTN"], capsys)
    g, d = spec["geometry"], spec["draft"]
    assert (d["algorithm"], d["layers"], d["kv_buffers"]) == ("NEXTN", 1, 1)
    assert (g["kv_bytes_per_token"], g["kv_buffers"]) == (70272 + 1152, 62)
    assert d["kv_bytes_per_token"] == 1152
    geo = geometry_from_config(BUILTIN["deepseek-v3"], 8, "bfloat16")
    assert d["expert_bytes_per_gpu"] == geo.expert_bytes_per_layer  # one MoE layer's routed experts, this rank
    # the rest: one MLA attention, the shared expert and router, eh_proj [7168, 14336] bf16, and the draft's own
    # embedding and head (vocab-parallel, freed only after the pool is sized), within a few MiB of priced parts
    embed_head = 2 * 129280 * 7168 // 8 * 2
    assert d["weight_bytes_per_gpu"] - d["expert_bytes_per_gpu"] > embed_head + 7168 * 14336 * 2
    weights = (g["expert_gib_per_gpu"] + g["dense_weight_gib_per_gpu"]) * GIB + d["weight_bytes_per_gpu"]
    budget = 140 * GIB * 0.9
    assert spec["baseline"]["kv_pool_tokens"] == pytest.approx((budget - weights) / 71424, abs=2)
    assert spec["baseline"]["kv_pool_tokens"] < plain["baseline"]["kv_pool_tokens"] * 70272 / 71424
    for key in ("0.05", "0.1"):  # the same groups free the same pages, now split over 62 buffers
        assert spec["ratios"][key]["offloaded_groups"] == plain["ratios"][key]["offloaded_groups"]
        assert spec["ratios"][key]["reclaimed_bytes_per_gpu"] == plain["ratios"][key]["reclaimed_bytes_per_gpu"]
        pages = kv_pages_per_buffer(spec["ratios"][key]["offloaded_groups"],
                                    plain["ratios"][key]["reclaimed_bytes_per_gpu"]
                                    // spec["ratios"][key]["offloaded_groups"] // PAGE, 62)
        assert _gain(spec, key) == pytest.approx(kv_rows_for_bytes(pages * PAGE, 1152), abs=2)
        assert _gain(spec, key) < _gain(plain, key)
        assert spec["ratios"][key]["staged_bytes_per_step"] == plain["ratios"][key]["staged_bytes_per_step"]


def test_eagle3_draft_for_qwen3_235b_adds_one_llama_layer_of_the_targets_kv_row(capsys):
    """Qwen3-235B at TP4 with its EAGLE3 draft (SpecForge's configs/qwen3-235B-A22B-eagle3.json: one Llama layer,
    hidden 4096, 64 heads, 4 KV heads of 128, draft vocab 32,000): one more K and V buffer of the target's row
    (one KV head of 128 per rank), and the draft's weights priced on this rank's shard."""
    plain = _run(QWEN_TP4, capsys)
    spec = _run([*QWEN_TP4, *EAGLE3], capsys)
    d, g = spec["draft"], spec["geometry"]
    assert (d["algorithm"], d["layers"], d["kv_buffers"], d["expert_bytes_per_gpu"]) == ("EAGLE3", 1, 2, 0)
    assert g["kv_bytes_per_token"] == plain["geometry"]["kv_bytes_per_token"] + 2 * 128 * 2
    assert g["kv_buffers"] == plain["geometry"]["kv_buffers"] + 2
    draft = DRAFTS["qwen3-235b-a22b-eagle3"]
    h, v, dv, inter = draft["hidden_size"], draft["vocab_size"], draft["draft_vocab_size"], draft["intermediate_size"]
    qkv = (64 * 128 + 2 * 4 * 128) * 2 * h // 4  # the input layer reads [embedding, hidden]: 2h wide
    expect = 2 * (v * h // 4 + dv * h // 4 + 3 * 4096 * h + qkv + h * 64 * 128 // 4 + 3 * inter * h // 4)
    assert d["weight_bytes_per_gpu"] == expect
    assert spec["baseline"]["kv_pool_tokens"] < plain["baseline"]["kv_pool_tokens"]
    for key in ("0.1", "0.2"):  # whole pages per buffer: 190 buffers may get as many as 188 did, never more
        assert 0 < _gain(spec, key) <= _gain(plain, key)
        groups = spec["ratios"][key]["offloaded_groups"]
        pages = kv_pages_per_buffer(groups, spec["ratios"][key]["reclaimed_bytes_per_gpu"] // groups // PAGE, 190)
        assert _gain(spec, key) == pytest.approx(kv_rows_for_bytes(pages * PAGE, 256), abs=1)


def test_qwen3_next_mtp_is_one_full_attention_moe_layer_plus_its_per_draft_token_state(capsys):
    """NEXTN on Qwen3-Next at TP4: the MTP layer is one full-attention layer (SGLang builds it with
    full_attention_interval 1, models/qwen3_next_mtp.py:66-74), so the cell gains one of the 12 attention layers'
    KV and two buffers grow with the target's; its MoE layer's 512 routed experts (a quarter of each on this
    rank) stay resident; and the per-draft-token state, per_req x (48 running requests + 1) x 4 draft tokens,
    is reported but not charged to the pool (see the next test)."""
    plain = _run(NEXT_TP4, capsys)
    spec = _run([*NEXT_TP4, "--speculative-algorithm", "NEXTN"], capsys)
    d, g, config = spec["draft"], spec["geometry"], BUILTIN["qwen3-next-80b-a3b"]
    cell = plain["geometry"]["kv_bytes_per_token"]
    assert (d["algorithm"], d["layers"], d["kv_buffers"]) == ("NEXTN", 1, 2)
    assert d["kv_bytes_per_token"] == cell // 12 and g["kv_bytes_per_token"] == cell + cell // 12
    assert g["kv_buffers"] == plain["geometry"]["kv_buffers"] + 2
    geo = geometry_from_config(config, 4, "bfloat16")
    assert d["expert_bytes_per_gpu"] == geo.expert_bytes_per_layer
    h, vocab, heads, head = 2048, 151936, 16, 256
    attention = (2 * heads * head // 4 + 2 * head) * h + h * heads * head // 4  # gated q, one KV head, o
    shared, router, gate, fc = 3 * 512 // 4 * h, 512 * h, h, 2 * h * h
    embed_head = 2 * vocab * h // 4  # the draft's own, shared with the target's only after sizing
    assert d["weight_bytes_per_gpu"] - d["expert_bytes_per_gpu"] == 2 * (attention + shared + router + gate + fc
                                                                          + embed_head)
    assert d["state_bytes_per_gpu"] == NEXT_STATE_PER_REQ_TP4 * (48 + 1) * 4
    for key in ("0.1", "0.2"):  # the same groups free the same pages, now over two more buffers
        assert spec["ratios"][key]["reclaimed_bytes_per_gpu"] == plain["ratios"][key]["reclaimed_bytes_per_gpu"]
        groups = spec["ratios"][key]["offloaded_groups"]
        pages = kv_pages_per_buffer(groups, spec["ratios"][key]["reclaimed_bytes_per_gpu"] // groups // PAGE,
                                    g["kv_buffers"])
        assert _gain(spec, key) == pytest.approx(kv_rows_for_bytes(pages * PAGE, cell // 12 // 2), abs=1)
        assert 0 < _gain(spec, key) <= _gain(plain, key)


def _sglang_default_kv_bytes(rest, per_req, draft):
    """SGLang 0.5.23's default hybrid sizing (no --max-mamba-cache-size, radix cache on, no_buffer: 3 state
    slots a request), written out from mem_cache/kv_cache_configurator.py:3345-3386 and 3404-3409: the state
    share is rest x 0.9 / 1.9; with a draft it is solved jointly for the slots K and the per-draft-token state
    of K / 3 requests, then only min(48, K // 3) + 1 requests' rows are taken; the KV pool gets the rest."""
    share = rest * 0.9 / 1.9
    if not draft:
        slots = int((share - per_req) // per_req)
        return rest - (slots + 1) * per_req, slots
    slots = int((share - per_req * 5) // (per_req * (1 + 4 / 3)))
    return rest - per_req * (min(48, slots // 3) + 1) * 4 - (slots + 1) * per_req, slots


def test_qwen3_next_mtp_state_comes_out_of_the_state_share_and_the_pool_gains_what_it_leaves(capsys):
    """Review of 57d0bf5: SGLang does not take the per-draft-token state from the KV pool. Its default sizing
    solves the state slots and that state together inside the state share, reserving it for K / 3 requests,
    and allocates it for the 48 running requests only, so the KV pool gets the rest: at TP4 on 140 GiB the
    slots fall from 2,3xx to under 1,000 and the pool grows. The planner leaves out the slots a server without
    a draft holds (as without a draft) and counts what the draft changes in the share."""
    plain = _run(NEXT_TP4, capsys)
    spec = _run([*NEXT_TP4, "--speculative-algorithm", "NEXTN"], capsys)
    d, g = spec["draft"], spec["geometry"]
    weights = (g["expert_gib_per_gpu"] + g["dense_weight_gib_per_gpu"]) * GIB + d["weight_bytes_per_gpu"]
    rest = 140 * GIB * 0.9 - weights
    kv_plain, slots_plain = _sglang_default_kv_bytes(rest, NEXT_STATE_PER_REQ_TP4, draft=False)
    kv_draft, slots = _sglang_default_kv_bytes(rest, NEXT_STATE_PER_REQ_TP4, draft=True)
    assert (d["state_slots_per_gpu"], d["state_slots_without_draft"]) == (slots, slots_plain)
    assert slots < slots_plain / 2 and slots // 3 >= 48
    assert d["kv_bytes_from_state_share"] == pytest.approx(kv_draft - kv_plain, abs=GIB // 1000)
    assert d["kv_bytes_from_state_share"] > d["state_bytes_per_gpu"] > 0  # the pool grows, it is not charged
    cell = g["kv_bytes_per_token"]
    assert spec["baseline"]["kv_pool_tokens"] == pytest.approx((rest + kv_draft - kv_plain) / cell, rel=1e-6)
    assert spec["baseline"]["kv_pool_tokens"] > plain["baseline"]["kv_pool_tokens"]


def test_a_state_share_too_small_for_one_slot_with_the_draft_is_refused_naming_the_memory(capsys):
    """SGLang stops when the joint solve leaves no state slot (kv_cache_configurator.py:3388-3402); the
    planner says so before anything is sized."""
    from vamp_sglang.capacity.draft import DraftError, StateSplit

    per_req = NEXT_STATE_PER_REQ_TP4
    assert StateSplit.solve(rest_bytes=20 * per_req, per_request=per_req, dp=1).slots == 1
    with pytest.raises(DraftError, match="--gpu-mem-gib"):
        StateSplit.solve(rest_bytes=10 * per_req, per_request=per_req, dp=1)


def test_qwen3_next_eagle_without_a_draft_path_is_its_mtp_layer_and_a_measured_pool_pays_no_state(capsys):
    """EAGLE without --speculative-draft-model-path is SGLang's NEXTN (the same MTP layer); with the pool SGLang
    logged (--kv-pool-gib) the state share is already out of it, so the measured pool sets the tokens."""
    nextn = _run([*NEXT_TP4, "--speculative-algorithm", "NEXTN"], capsys)
    eagle = _run([*NEXT_TP4, "--speculative-algorithm", "EAGLE"], capsys)
    assert eagle["draft"] | {"algorithm": None} == nextn["draft"] | {"algorithm": None}
    assert eagle["ratios"] == nextn["ratios"]
    measured = _run([*NEXT_TP4, "--speculative-algorithm", "NEXTN", "--kv-pool-gib", "8"], capsys)
    assert measured["baseline"]["kv_pool_tokens"] == 8 * GIB // nextn["geometry"]["kv_bytes_per_token"]


def test_qwen3_next_with_an_eagle3_draft_is_refused_in_the_launchers_words(capsys):
    from vamp_sglang.refusals.hybrid import message

    err = _refused([*NEXT_TP4, *EAGLE3], capsys)
    assert message("speculative") in err


def test_the_text_table_names_the_draft(capsys):
    from vamp_sglang.capacity.__main__ import main

    assert main([*[a for a in DEEPSEEK_TP8 if a != "--json"], "--speculative-algorithm", "EAGLE"]) == 0
    out = capsys.readouterr().out
    assert "draft (EAGLE): 1 layer" in out and "resident" in out and "state" not in out
    assert main([*[a for a in NEXT_TP4 if a != "--json"], "--speculative-algorithm", "NEXTN"]) == 0
    out = capsys.readouterr().out
    assert "per-draft-token state 3.53 GiB" in out and "state slots" in out and "KV pool gains" in out


def test_a_draft_config_json_is_read_like_the_builtin(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**DRAFTS["qwen3-235b-a22b-eagle3"], "architectures": ["LlamaForCausalLMEagle3"]}))
    builtin = _run([*QWEN_TP4, *EAGLE3], capsys)
    local = _run([*QWEN_TP4, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(tmp_path)],
                 capsys)
    assert local["draft"] | {"source": None} == builtin["draft"] | {"source": None}
    assert local["ratios"] == builtin["ratios"]


@pytest.mark.parametrize("argv, named", [
    ([*QWEN_TP4, "--speculative-algorithm", "EAGLE3"], "--speculative-draft-model-path"),
    ([*QWEN_TP4, "--speculative-draft-model-path", "qwen3-235b-a22b-eagle3"], "--speculative-algorithm"),
    ([*QWEN_TP4, "--speculative-algorithm", "NEXTN"], "--speculative-algorithm NEXTN"),
    (["--model", "kimi-k2", "--gpu-mem-gib", "140", "--tp", "8", "--speculative-algorithm", "EAGLE"],
     "--speculative-algorithm EAGLE"),
    ([*DEEPSEEK_TP8, "--speculative-algorithm", "NEXTN", "--speculative-draft-model-path",
      "qwen3-235b-a22b-eagle3"], "--speculative-draft-model-path"),
    ([*QWEN_TP4, "--speculative-algorithm", "STANDALONE"], "--speculative-algorithm"),
    ([*QWEN_TP4, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "no-such-draft"],
     "--speculative-draft-model-path"),
    ([*NEXT_TP4, "--speculative-algorithm", "NGRAM"], "--speculative-algorithm"),
    ([*NEXT_TP4, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "qwen3-235b-a22b-eagle3"],
     "--speculative-draft-model-path"),
    (["--model", "qwen3.6-35b-a3b", "--gpu-mem-gib", "140", "--tp", "1", "--speculative-algorithm", "NEXTN"],
     "--speculative-algorithm NEXTN"),
    ([*QWEN_TP4, *EAGLE3, "--hicache-gib", "100"], "--hicache-gib"),
])
def test_a_draft_the_planner_cannot_price_exits_2_naming_the_flag(argv, named, capsys):
    assert named in _refused(argv, capsys)


def test_a_draft_whose_kv_row_differs_from_the_targets_is_refused(tmp_path, capsys):
    """VAMP grows the draft's buffers by the target's row count, which needs equal rows (draft_pools.py); a draft
    with 8 KV heads against Qwen3-235B's 4 has two heads per rank at TP4, twice the target's row."""
    (tmp_path / "config.json").write_text(json.dumps({**DRAFTS["qwen3-235b-a22b-eagle3"], "num_key_value_heads": 8}))
    err = _refused([*QWEN_TP4, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(tmp_path)],
                   capsys)
    assert "--speculative-draft-model-path" in err and "KV row" in err


def _nextn_checkpoint(tmp_path):
    """DeepSeek-V3's NextN checkpoint as its export writes it: the target's config, one layer, the NextN
    architecture (SGLang builds its layer with is_nextn: MLA and a MoE layer with every routed expert)."""
    (tmp_path / "nextn").mkdir()
    (tmp_path / "nextn" / "config.json").write_text(json.dumps(
        {**BUILTIN["deepseek-v3"], "architectures": ["DeepseekV3ForCausalLMNextN"], "num_hidden_layers": 1}))
    return str(tmp_path / "nextn")


def test_deepseeks_nextn_checkpoint_as_an_eagle_draft_is_priced_as_its_mtp_layer(tmp_path, capsys):
    """DeepSeek's usual MTP launch (`EAGLE --speculative-draft-model-path <DeepSeek-V3-NextN>`), which the
    server and the launcher serve (both MLA latents 576): the same MLA latent buffer and the same weights as
    the target's own MTP layer (NEXTN), which SGLang builds from this checkpoint's config."""
    from vamp_sglang.refusals.speculative import draft_row_refused

    draft = _nextn_checkpoint(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(BUILTIN["deepseek-v3"]))
    sg = argparse.Namespace(speculative_draft_model_path=draft, model_path=str(tmp_path / "target"), attn_dp_size=1,
                            dp_size=1, enable_dp_attention=False, tp_size=8, attn_cp_size=1)
    assert draft_row_refused(sg) is None
    mtp = _run([*DEEPSEEK_TP8, "--speculative-algorithm", "NEXTN"], capsys)
    nextn = _run([*DEEPSEEK_TP8, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", draft], capsys)
    assert (nextn["draft"]["algorithm"], nextn["draft"]["source"]) == ("EAGLE", str(tmp_path / "nextn" / "config.json"))
    assert nextn["draft"] | {"algorithm": None, "source": None} == mtp["draft"] | {"algorithm": None, "source": None}
    assert (nextn["draft"]["kv_buffers"], nextn["draft"]["kv_bytes_per_token"]) == (1, 1152)
    assert nextn["ratios"] == mtp["ratios"] and nextn["geometry"] == mtp["geometry"]


def test_a_gqa_draft_on_an_mla_target_is_refused_as_the_launcher_refuses_it(tmp_path, capsys):
    """One row rule (refusals/speculative.py) for the planner and the launcher: a Llama draft's KV heads against
    DeepSeek's MLA latent, and DeepSeek's NextN against Qwen3-235B's heads, each named in the message."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(DRAFTS["qwen3-235b-a22b-eagle3"]))
    err = _refused([*DEEPSEEK_TP8, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(llama)],
                   capsys)
    assert "--speculative-draft-model-path" in err and "1 KV heads x 128" in err and "MLA latent of 576" in err
    err = _refused([*QWEN_TP4, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                    _nextn_checkpoint(tmp_path)], capsys)
    assert "MLA latent of 576" in err and "1 KV heads x 128" in err


@pytest.mark.long  # importing SGLang's config module takes about 6 s here
@pytest.mark.parametrize("attn_tp", [1, 4, 8, 32])
def test_the_state_bytes_per_request_are_sglangs_mamba_cache_per_req(attn_tp):
    """The planner's arithmetic against SGLang's own Mamba2StateShape and mamba_cache_per_req for Qwen3-Next
    (configs/qwen3_next.py:288-313) in its default dtypes, key groups replicated once the ranks outnumber them."""
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

    from vamp_sglang.capacity.draft import _state_bytes_per_request

    config = BUILTIN["qwen3-next-80b-a3b"]
    key, value = config["linear_num_key_heads"], config["linear_num_value_heads"]
    shape = Mamba2StateShape.create(
        tp_world_size=attn_tp, intermediate_size=config["linear_value_head_dim"] * value, n_groups=key,
        num_heads=value, head_dim=config["linear_value_head_dim"], state_size=config["linear_key_head_dim"],
        conv_kernel=config["linear_conv_kernel_dim"])
    layers = [i for i in range(config["num_hidden_layers"]) if (i + 1) % config["full_attention_interval"]]
    sglang = Mamba2CacheParams(shape=shape, layers=layers,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    assert _state_bytes_per_request(config, len(layers), attn_tp) == sglang.mamba_cache_per_req


@pytest.mark.long  # importing SGLang's configurator takes about 10 s here
@pytest.mark.parametrize("rest_gib, dp", [(87.75, 1), (30.0, 1), (4.0, 1), (60.0, 4)])
def test_the_state_split_is_sglangs_default_mamba_sizing(rest_gib, dp, monkeypatch):
    """StateSplit against SGLang's own _handle_max_mamba_cache (kv_cache_configurator.py:3229-3409) and
    _calculate_mamba_ratio, run on the flags VAMP launches a hybrid model with (radix cache on, no_buffer,
    no --max-mamba-cache-size, the default --mamba-full-memory-ratio): the slots with and without the draft,
    and what the KV pool gets, to a byte's rounding of SGLang's GiB floats. 4 GiB: fewer than 48 requests."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache import kv_cache_configurator as kvc

    from vamp_sglang.capacity.draft import StateSplit

    per_req = NEXT_STATE_PER_REQ_TP4

    def sglang(draft):
        schedule = SimpleNamespace(max_mamba_cache_size=None, max_running_requests=48 if draft else None,
                                   mamba_full_memory_ratio=0.9)
        monkeypatch.setattr(kvc, "get_schedule", lambda: schedule)
        monkeypatch.setattr(kvc, "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=4))
        monkeypatch.setattr(kvc, "get_memory", lambda: SimpleNamespace(disable_radix_cache=False,
                                                                       enable_unified_memory=False))
        monkeypatch.setattr(kvc, "get_exec", lambda: SimpleNamespace(mamba=SimpleNamespace(
            enable_linear_replayssm_spec=False, enable_mamba_extra_buffer=False)))
        monkeypatch.setattr(kvc, "get_disagg", lambda: SimpleNamespace(disaggregation_mode="null"))
        monkeypatch.setattr(kvc, "get_context", lambda: SimpleNamespace(
            override=lambda _why, **values: schedule.__dict__.update(values)))
        params = SimpleNamespace(layers=list(range(36)), mamba_cache_per_req=per_req)
        fake = SimpleNamespace(
            mambaish_config=SimpleNamespace(mamba2_cache_params=params), pp_size=1, attn_dp_size=dp,
            fused_entry_bytes=lambda _name: None, hybrid_gdn_config=object(), hybrid_kda_config=None,
            extra_mamba_cache_bytes_per_req=0, spec_algorithm=SimpleNamespace(is_none=lambda: not draft))
        fake._calculate_mamba_ratio = lambda: kvc.KVCacheConfigurator._calculate_mamba_ratio(fake)
        kv_gib = kvc.KVCacheConfigurator._handle_max_mamba_cache(fake, rest_gib)
        return kv_gib * GIB, schedule.max_mamba_cache_size

    (kv_plain, slots_plain), (kv_draft, slots) = sglang(False), sglang(True)
    split = StateSplit.solve(rest_gib * GIB, per_req, dp)
    assert (split.slots, split.slots_without_draft) == (slots, slots_plain)
    assert split.kv_gain_bytes == pytest.approx(kv_draft - kv_plain, abs=64)
    assert rest_gib * GIB - kv_draft - split.reserve_bytes == pytest.approx((slots + 1) * per_req, abs=64)


@pytest.mark.long  # writing the two tiny checkpoints takes about 15 s here
def test_the_tiny_checkpoints_grow_as_the_cpu_server_measured_with_speculation(tmp_path, capsys):
    """tests/test_speculative_vamp_server.py (2026-12-07, docs/speculative.md): VAMP-20 on a 512-token float32
    pool grew the tiny DeepSeek-V3 with its MTP draft to 33,280 tokens and the tiny Qwen3-MoE with its EAGLE3
    draft to 12,800. Without the MTP layer's buffer the planner would say 39,834."""
    from vamp_sglang.tiny_moe.checkpoint import make_checkpoint
    from vamp_sglang.tiny_moe.eagle3 import write_eagle3_draft

    small = ["--gpu-mem-gib", "4", "--tp", "1", "--max-total-tokens", "512", "--dtype", "float32", "--ratios", "0.2",
             "--json"]
    deepseek = str(make_checkpoint(tmp_path / "deepseek", arch="deepseek_v3"))
    qwen = make_checkpoint(tmp_path / "qwen", arch="qwen3_moe")
    draft = str(write_eagle3_draft(qwen, tmp_path / "draft"))
    mtp = _run(["--model", deepseek, *small, "--speculative-algorithm", "EAGLE"], capsys)
    eagle3 = _run(["--model", str(qwen), *small, "--speculative-algorithm", "EAGLE3",
                   "--speculative-draft-model-path", draft], capsys)
    assert mtp["ratios"]["0.2"]["kv_pool_tokens"] == 33280
    assert _run(["--model", deepseek, *small], capsys)["ratios"]["0.2"]["kv_pool_tokens"] > 33280
    assert eagle3["ratios"]["0.2"]["kv_pool_tokens"] == 12800
