"""Expert features VAMP cannot serve, and the memory saver and model implementations around the experts,
refused by name with VAMP on (paths under sglang/srt of SGLang 0.5.23; the review behind the first five is
research/gpu-review-3.md, defects 3 and 6).

- Expert parallelism SGLang turns on by itself, past the launcher's `--ep-size > 1` refusal: each MoE
  all-to-all backend in `_A2A_EP_SPANNING_BACKENDS` gets `ep_size = tp_size`
  (arg_groups/overrides.py:1577-1620); `--moe-runner-backend megamoe` is an alias for
  `--moe-a2a-backend megamoe` (arg_groups/mega_moe_hook.py:259-279); `--enable-waterfill` forces `deepep`
  (overrides.py:1595-1607); `--enable-prefill-cp` on an MLA model sets `moe_a2a_backend=deepep,
  ep_size=tp_size` (arg_groups/model_overrides/deepseek_v2.py:191-202). VAMP pages experts on the assumption
  that every rank holds a shard of every expert, and DeepEP's dispatch output carries no top-k ids, so routed
  staging would fall back to whole copies. Every `--moe-a2a-backend` but `none` is refused (`ascend_tp`, the
  one that spans nothing, runs on NPUs, where VAMP has no page backend).
- Expert placement that moves experts between ranks or adds replicas: `--enable-eplb`,
  `--ep-num-redundant-experts` above 0, `--init-expert-location` other than `trivial`, elastic EP
  (`--elastic-ep-backend`; arg_groups/fields/exec_.py:914-957): VAMP lays out its offloaded rows and their
  host copies once, by expert id, at start.
- `--enable-return-routed-experts`: its host cache is sized once, to the start-up pool
  (model_executor/model_runner.py:1222-1238, mem_cache/kv_index_translator.py:260-268), and indexed by KV
  location (state_capturer/base.py:117-118, 219-220), so the first token written to a grown row raises
  IndexError in the scheduler; compaction would also move KV rows without their captured experts.
- `--enable-memory-saver`: `release_memory_occupation` pauses what SGLang allocated in its weight and KV
  regions (managers/scheduler_components/weight_updater.py:337-374), while VAMP's expert pages and grown KV
  buffers are VAMP's own mappings, which a release keeps held and a resume does not restore.
- `--model-impl transformers|mindspore`: the Transformers backend routes in Transformers' own modules and hands
  the ids to `TransformersFusedMoE` through a custom op (models/transformers.py:329-420), past SGLang's TopK
  layer, where VAMP reads the ids for routed staging and applies its expert order; no test covers it.
These stay refused when the launcher's generic `--ep-size` and DP-attention refusals are lifted. No SGLang
import: the launcher answers in a second.
"""

from __future__ import annotations

import argparse

_SUFFIX = "is not supported with --vamp-max-offload-ratio > 0"
_EP = "SGLang then sets ep_size = tp_size itself: expert parallelism, which VAMP's paging does not serve"
_PLACEMENT = "it moves or replicates experts between ranks, while VAMP lays out the offloaded experts once"
_LORA = ("LoRA's MoE wrapper runs the experts outside VAMP's staging (lora/layers.py:1095-1106, 1260-1307), "
         "so an offloaded expert would be read from rows lent to the KV pool")
_ROUTED_CAPTURE = ("its routed-experts host cache is sized to the start-up KV pool and indexed by KV "
                   "location, so the first token in a grown row would raise IndexError in the scheduler")

_MEMORY_SAVER = ("its release and resume pause SGLang's weight and KV regions, not VAMP's expert pages and grown "
                 "KV buffers (managers/scheduler_components/weight_updater.py:337-374)")
_MODEL_IMPL = ("its router runs outside SGLang's TopK layer, where VAMP reads routed ids and applies its expert "
               "order (models/transformers.py:329-420); untested with VAMP: use --model-impl sglang")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The SGLang flags `refused` reads, for the launcher's SGLang-free view of the argv."""
    parser.add_argument("--moe-a2a-backend", default="none")
    parser.add_argument("--moe-runner-backend", default=None)
    parser.add_argument("--elastic-ep-backend", default=None)
    parser.add_argument("--init-expert-location", default="trivial")
    parser.add_argument("--ep-num-redundant-experts", type=int, default=0)
    for flag in ("--enable-waterfill", "--enable-prefill-cp", "--enable-eplb",
                 "--enable-return-routed-experts", "--enable-lora", "--enable-memory-saver"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--lora-paths", nargs="*", default=None)
    parser.add_argument("--model-impl", default="auto")


def refused(sg: argparse.Namespace) -> str | None:
    """The refusal, naming the flag and its value, of the first expert feature VAMP cannot serve; or None."""
    redundant, location, elastic = sg.ep_num_redundant_experts, sg.init_expert_location, sg.elastic_ep_backend
    impl = sg.model_impl
    named = [
        (f"--moe-a2a-backend {sg.moe_a2a_backend}", sg.moe_a2a_backend != "none", _EP),
        ("--moe-runner-backend megamoe", sg.moe_runner_backend == "megamoe",
         f"an alias for --moe-a2a-backend megamoe: {_EP}"),
        ("--enable-waterfill", sg.enable_waterfill, f"it forces --moe-a2a-backend deepep: {_EP}"),
        ("--enable-prefill-cp", sg.enable_prefill_cp,
         f"on an MLA model it forces --moe-a2a-backend deepep: {_EP}; elsewhere untested with VAMP"),
        ("--enable-eplb", sg.enable_eplb, _PLACEMENT),
        (f"--ep-num-redundant-experts {redundant}", redundant > 0, _PLACEMENT),
        (f"--init-expert-location {location}", location != "trivial", _PLACEMENT),
        (f"--elastic-ep-backend {elastic}", elastic not in (None, "none"), _PLACEMENT),
        ("--enable-return-routed-experts", sg.enable_return_routed_experts, _ROUTED_CAPTURE),
        ("--enable-lora", sg.enable_lora, _LORA),
        ("--lora-paths", sg.lora_paths is not None, f"it turns on --enable-lora: {_LORA}"),
        ("--enable-memory-saver", sg.enable_memory_saver, _MEMORY_SAVER),
        (f"--model-impl {impl}", impl not in ("auto", "sglang"), _MODEL_IMPL),
    ]
    return next((f"{flag} {_SUFFIX} ({why})" for flag, on, why in named if on), None)
