"""Expert features VAMP cannot serve are refused by name with VAMP on, before anything loads, whether or not
`--ep-size` is given (review gpu-review-3, defects 3 and 6): the MoE all-to-all backends and the flags for
which SGLang sets ep_size = tp_size itself, expert placement (EPLB, redundant experts, an initial expert
location, elastic EP), the routed-experts capture sized to the start-up pool, the memory saver's release and
resume, and the Transformers and MindSpore model implementations. With VAMP off the flags
reach SGLang untouched."""

from __future__ import annotations

import argparse

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError

MODEL = ["--model-path", "/nonexistent/model"]
VAMP = ["--vamp-max-offload-ratio", "0.2"]

REFUSED = [  # (flags, what the refusal names)
    (["--moe-runner-backend", "megamoe"], "--moe-runner-backend megamoe"),
    (["--enable-waterfill"], "--enable-waterfill"),
    (["--enable-prefill-cp"], "--enable-prefill-cp"),
    (["--enable-eplb"], "--enable-eplb"),
    (["--ep-num-redundant-experts", "32"], "--ep-num-redundant-experts 32"),
    (["--init-expert-location", "/tmp/expert_location.json"], "--init-expert-location"),
    (["--elastic-ep-backend", "mooncake"], "--elastic-ep-backend mooncake"),
    (["--enable-return-routed-experts"], "--enable-return-routed-experts"),
    (["--enable-lora"], "--enable-lora"),
    (["--lora-paths", "/adapters/a"], "--lora-paths"),
    (["--enable-memory-saver"], "--enable-memory-saver"),
    (["--model-impl", "transformers"], "--model-impl transformers"),
    (["--model-impl", "mindspore"], "--model-impl mindspore"),
]


def _sglang_choices(flag: str) -> list[str]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return next(action.choices for action in parser._actions if flag in action.option_strings)


@pytest.mark.parametrize("flags,named", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_expert_features_are_refused_by_name_without_ep_size(flags, named):
    with pytest.raises(ConfigError, match=f"{named}.*--vamp-max-offload-ratio") as err:
        launch_server.prepare(MODEL + flags + VAMP)
    assert "--ep-size" not in str(err.value)
    stock = launch_server.prepare(MODEL + flags + ["--vamp-max-offload-ratio", "0"])
    assert stock.sglang_argv == MODEL + flags


def test_every_moe_a2a_backend_sglang_lists_but_none_is_refused():
    """Read from SGLang 0.5.23's own parser, so a backend added there is refused here too."""
    backends = _sglang_choices("--moe-a2a-backend")
    assert {"deepep", "deepep_v2", "mooncake", "megamoe"} <= set(backends)
    for backend in [b for b in backends if b != "none"]:
        with pytest.raises(ConfigError, match=f"--moe-a2a-backend {backend} .*ep_size = tp_size"):
            launch_server.prepare(MODEL + ["--moe-a2a-backend", backend] + VAMP)
    assert launch_server.prepare(MODEL + ["--moe-a2a-backend", "none"] + VAMP).vamp.enabled


@pytest.mark.parametrize("flags", [
    ["--ep-num-redundant-experts", "0"], ["--init-expert-location", "trivial"],
    ["--elastic-ep-backend", "none"], ["--moe-runner-backend", "triton"],
    ["--model-impl", "auto"], ["--model-impl", "sglang"],
], ids=" ".join)
def test_the_defaults_spelled_out_are_served(flags):
    assert launch_server.prepare(MODEL + flags + VAMP).vamp.enabled


@pytest.mark.parametrize("text,named", [
    ("moe-a2a-backend: deepep\n", "--moe-a2a-backend deepep"),
    ("enable-return-routed-experts: true\n", "--enable-return-routed-experts"),
    ("enable-lora: true\n", "--enable-lora"),
    ("enable-memory-saver: true\n", "--enable-memory-saver"),
    ("model-impl: transformers\n", "--model-impl transformers"),
])
def test_the_same_set_in_a_config_file_is_refused(tmp_path, text, named):
    path = tmp_path / "server.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named):
        launch_server.prepare(MODEL + ["--config", str(path)] + VAMP)
