"""Bad flags are refused by the launcher within seconds, before SGLang or the model loads."""

import subprocess
import sys
import time

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError, VampConfig

MODEL = ["--model-path", "/nonexistent/model"]  # never loaded: validation must fail first

BAD_FLAGS = [
    (["--vamp-max-offload-ratio", "1.5"], "--vamp-max-offload-ratio"),
    (["--vamp-max-offload-ratio", "1"], "--vamp-max-offload-ratio"),
    (["--vamp-max-offload-ratio", "-0.1"], "--vamp-max-offload-ratio"),
    (["--vamp-max-offload-ratio", "nan"], "--vamp-max-offload-ratio"),
    (["--vamp-max-offload-ratio", "abc"], "--vamp-max-offload-ratio"),
    (["--vamp-policy", "random"], "--vamp-policy"),
    (["--vamp-alpha", "0"], "--vamp-alpha"),
    (["--vamp-alpha", "1.5"], "--vamp-alpha"),
    (["--vamp-tau-steps", "0"], "--vamp-tau-steps"),
    (["--vamp-tau-steps", "2.5"], "--vamp-tau-steps"),
    (["--vamp-t-prefill-us", "0"], "--vamp-t-prefill-us"),
    (["--vamp-t-prefill-us", "inf"], "--vamp-t-prefill-us"),
    (["--vamp-t-sched-us", "-1"], "--vamp-t-sched-us"),
    (["--vamp-t-queue-us", "-5"], "--vamp-t-queue-us"),
    (["--vamp-c-reload-ms", "-0.63"], "--vamp-c-reload-ms"),
    (["--vamp-expand-groups", "0"], "--vamp-expand-groups"),
    (["--vamp-restore-after-steps", "-1"], "--vamp-restore-after-steps"),
    (["--vamp-page-backend", "nvme"], "--vamp-page-backend"),
    (["--vamp-page-backend", "cuda", "--device", "cpu"], "--vamp-page-backend"),
    (["--vamp-page-backend", "host", "--device", "cuda"], "--vamp-page-backend"),
    (["--radix-eviction-policy", "vamp"], "--radix-eviction-policy"),
    (["--radix-cache-backend", "lmcache"], "--radix-cache-backend"),
    (["--disable-radix-cache"], "--disable-radix-cache"),
    (["--pp-size", "2"], "--pp-size"),
    (["--enable-pdmux"], "--enable-pdmux"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file"], "--hicache-storage-backend"),
    (["--enable-hierarchical-cache", "--page-size", "16"], "--page-size"),
    (["--enable-hierarchical-cache", "--device", "cpu", "--hicache-io-backend", "kernel"], "--hicache-io-backend"),
    (["--vamp-decision-log", "/nonexistent-dir/decisions.jsonl"], "--vamp-decision-log"),
    (["--tp-size", "0"], "--tp-size"),
    (["--vamp-initial-offload-ratio", "0.2"], "--vamp-initial-offload-ratio"),
    (["--vamp-initial-offload-ratio", "-0.1"], "--vamp-initial-offload-ratio"),
    (["--vamp-controller-port", "70000"], "--vamp-controller-port"),
    (["--vamp-controller-port", "-1"], "--vamp-controller-port"),
    (["--vamp-controller-key-file", "/nonexistent/vamp.key"], "--vamp-controller-key-file"),
    (["--nnodes", "2", "--tp-size", "2"], "--dist-init-addr"),
    (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:25000"], "--vamp-controller-key-file"),
    (["--nnodes", "2", "--node-rank", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:25000"], "--node-rank"),
    (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "127.0.0.1:25000"], "--tp-size"),
    (["--vamp-tpot-slo-ms", "0"], "--vamp-tpot-slo-ms"),
    (["--vamp-tpot-slo-ms", "-50"], "--vamp-tpot-slo-ms"),
    (["--vamp-tpot-slo-ms", "nan"], "--vamp-tpot-slo-ms"),
    (["--vamp-tpot-slo-ms", "inf"], "--vamp-tpot-slo-ms"),
    (["--vamp-tpot-slo-ms", "fast"], "--vamp-tpot-slo-ms"),
    (["--vamp-staging", "fast"], "--vamp-staging"),
    (["--vamp-staging", ""], "--vamp-staging"),
    (["--vamp-staging", "host", "--device", "cuda", "--moe-runner-backend", "flashinfer_cutlass"], "--vamp-staging"),
    (["--vamp-expert-order", "hot"], "--vamp-expert-order"),
    (["--vamp-tree-core", "c"], "--vamp-tree-core"),
    (["--vamp-tree-core", "rust", "--enable-session-radix-cache"], "--vamp-tree-core"),
    (["--vamp-tree-core", "rust", "--enable-hierarchical-cache"], "--vamp-tree-core"),
]


@pytest.mark.parametrize("flags,named", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_raise_naming_the_flag(flags, named):
    with pytest.raises((ConfigError, SystemExit)) as err:
        launch_server.prepare(MODEL + flags)
    if err.type is ConfigError:
        assert named in str(err.value)


@pytest.mark.parametrize("flags,named", BAD_FLAGS[:3] + BAD_FLAGS[18:20], ids=lambda v: str(v))
def test_cli_exits_nonzero_within_seconds(flags, named):
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "vamp_sglang.launch_server", *MODEL, *flags],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert named in proc.stderr
    assert time.monotonic() - start < 30, "validation must not wait for SGLang to import"


HYBRID_REFUSED = [
    (["--enable-unified-memory"], "--enable-unified-memory"),
    (["--mamba-radix-cache-strategy", "extra_buffer"], "--mamba-radix-cache-strategy no_buffer"),
    (["--mamba-radix-cache-strategy=extra_buffer_lazy"], "--mamba-radix-cache-strategy no_buffer"),
    (["--enable-int8-mamba-checkpoint"], "--enable-int8-mamba-checkpoint"),
    (["--enable-linear-replayssm"], "--enable-linear-replayssm"),
    (["--enable-linear-replayssm-spec"], "--enable-linear-replayssm-spec"),
    (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm"),  # no draft KV, but per-draft state
    (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm"),  # served on a dense model, not here
]


def _model_dir(path, model_type):
    path.mkdir()
    (path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    return ["--model-path", str(path), "--device", "cpu"]


@pytest.mark.parametrize("flags,named", HYBRID_REFUSED, ids=[" ".join(f) for f, _ in HYBRID_REFUSED])
def test_unsupported_hybrid_flags_are_refused_before_loading(tmp_path, flags, named):
    """A hybrid model's state features VAMP cannot price are refused from the flags and config.json, in
    the words the scheduler-start check uses for what only the built pools show; stock (ratio 0) and a
    dense model with the same flags are left to SGLang."""
    hybrid = _model_dir(tmp_path / "next", "qwen3_next")
    with pytest.raises(ConfigError, match="VAMP does not support this hybrid model configuration") as err:
        launch_server.prepare(hybrid + ["--vamp-max-offload-ratio", "0.2", *flags])
    assert named in str(err.value)
    assert not launch_server.prepare(hybrid + ["--vamp-max-offload-ratio", "0", *flags]).vamp.enabled
    dense = _model_dir(tmp_path / "moe", "qwen3_moe")
    assert launch_server.prepare(dense + ["--vamp-max-offload-ratio", "0.2", *flags]).vamp.enabled


REFUSED_ON_EVERY_MODEL = [  # issue 19 item 5
    (["--enable-pdmux"], "--enable-pdmux"),
    (["--enable-pdm"], "--enable-pdmux"),  # SGLang's parser takes unique abbreviations
    (["--enable-nvidia-megakernel"], "--enable-nvidia-megakernel"),
    (["--speculative-algorithm", "DFLASH"], "--speculative-algorithm DFLASH"),
    (["--speculative-algorithm", "STANDALONE"], "--speculative-algorithm STANDALONE"),
    (["--speculative-algorithm=dspark"], "--speculative-algorithm dspark"),
    (["--speculative-algorithm", "MY_REGISTERED_DRAFT"], "--speculative-algorithm MY_REGISTERED_DRAFT"),
    (["--speculative-algo", "STANDALONE"], "--speculative-algorithm STANDALONE"),
]
REFUSED_FROM_CONFIG_FILE = [  # SGLang's --config YAML: each key becomes `--key` ahead of the command line
    ("enable-pdmux: true\n", "--enable-pdmux"),
    ("enable-nvidia-megakernel: true\n", "--enable-nvidia-megakernel"),
    ("speculative-algorithm: STANDALONE\nspeculative-num-steps: 3\n", "--speculative-algorithm"),
]


def _config_file(tmp_path, text):
    path = tmp_path / "server.yaml"
    path.write_text(text)
    return ["--config", str(path)]


@pytest.mark.parametrize("flags,named", REFUSED_ON_EVERY_MODEL, ids=[" ".join(f) for f, _ in REFUSED_ON_EVERY_MODEL])
def test_pdmux_megakernel_and_draft_speculation_are_refused_on_every_model(tmp_path, flags, named):
    """Split prefill restarts expert staging per layer chunk, the megakernel keeps the freed expert weights, and
    the draft algorithms other than EAGLE, EAGLE3 and NEXTN build draft pools VAMP does not grow: refused with
    VAMP on, on a dense MoE model as on any; with VAMP off the flags reach SGLang untouched."""
    dense = _model_dir(tmp_path / "moe", "qwen3_moe")[:2]
    for model in (MODEL, dense):
        with pytest.raises(ConfigError, match=named):
            launch_server.prepare(model + flags + ["--vamp-max-offload-ratio", "0.2"])
        assert launch_server.prepare(model + flags + ["--vamp-max-offload-ratio", "0"]).sglang_argv == model + flags


@pytest.mark.parametrize("text,named", REFUSED_FROM_CONFIG_FILE, ids=[n for _, n in REFUSED_FROM_CONFIG_FILE])
def test_the_same_features_switched_on_in_a_config_file_are_refused(tmp_path, text, named):
    flags = _config_file(tmp_path, text)
    with pytest.raises(ConfigError, match=named):
        launch_server.prepare(MODEL + flags + ["--vamp-max-offload-ratio", "0.2"])
    assert launch_server.prepare(MODEL + flags + ["--vamp-max-offload-ratio", "0"]).sglang_argv == MODEL + flags


@pytest.mark.parametrize("flags", [
    ["--speculative-algorithm", "NGRAM"],  # no draft model, so no draft KV pool (SGLang's has_draft_kv)
    ["--speculative-algorithm", "ngram"],
    ["--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states"],  # names a capture, no draft
    ["--speculative-algorithm", "EAGLE"],  # draft pools that grow with the target's (issue 46)
    ["--speculative-algorithm=eagle3"],
    ["--speculative-algorithm", "NEXTN"],
    ["--speculative-algo", "EAGLE"],
], ids=" ".join)
def test_speculation_without_a_draft_kv_pool_or_with_a_growing_one_is_served_on_a_dense_model(flags):
    assert launch_server.prepare(MODEL + flags + ["--vamp-max-offload-ratio", "0.2"]).vamp.enabled


def test_a_config_file_that_leaves_the_features_off_is_served(tmp_path):
    flags = _config_file(tmp_path, "enable-pdmux: false\nspeculative-algorithm: NGRAM\nmem-fraction-static: 0.8\n")
    assert launch_server.prepare(MODEL + flags + ["--vamp-max-offload-ratio", "0.2"]).vamp.enabled


REFUSED_KERNELS_AND_EXPERT_FEATURES = [  # tests/test_attention_refusals.py, tests/test_expert_refusals.py
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),  # no local config.json: may be MLA
    (["--attention-backend", "flashmla"], "--attention-backend flashmla"),
    (["--page-size", "64"], "--page-size 64"),
    (["--moe-a2a-backend", "deepep"], "--moe-a2a-backend deepep"),
    (["--enable-eplb"], "--enable-eplb"),
    (["--enable-return-routed-experts"], "--enable-return-routed-experts"),
]


@pytest.mark.parametrize("flags,named", REFUSED_ON_EVERY_MODEL[::3] + [(["--config"], "--enable-pdmux")]
                         + REFUSED_KERNELS_AND_EXPERT_FEATURES, ids=lambda v: str(v))
def test_each_refusal_answers_within_a_second_as_a_subprocess(tmp_path, flags, named):
    if flags == ["--config"]:
        flags = _config_file(tmp_path, REFUSED_FROM_CONFIG_FILE[0][0])
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", *MODEL, *flags,
                           "--vamp-max-offload-ratio", "0.2"], check=False, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert elapsed < 1.0, f"refusal took {elapsed:.2f} s"


def test_ratio_zero_is_stock_argv():
    launch = launch_server.prepare(MODEL + ["--vamp-max-offload-ratio", "0", "--device", "cuda"])
    assert not launch.vamp.enabled
    assert launch.sglang_argv == MODEL + ["--device", "cuda"]


def test_vamp_on_selects_our_tree_and_exports_config():
    launch = launch_server.prepare(MODEL + ["--vamp-max-offload-ratio", "0.2", "--vamp-alpha", "0.4"])
    assert launch.sglang_argv[-4:] == ["--radix-cache-backend", "vamp", "--radix-eviction-policy", "vamp"]
    import json

    exported = json.loads(launch.env["VAMP_SGLANG_CONFIG"])
    assert exported["max_offload_ratio"] == 0.2 and exported["alpha"] == 0.4
    assert launch.env["VAMP_SGLANG_ENABLE"] == "1"


def test_tpot_slo_is_off_by_default_and_travels_to_the_schedulers_when_set():
    import json

    assert VampConfig().tpot_slo_ms is None
    assert json.loads(launch_server.prepare(MODEL).env["VAMP_SGLANG_CONFIG"])["tpot_slo_ms"] is None
    launch = launch_server.prepare(MODEL + ["--vamp-tpot-slo-ms", "120.5"])
    assert json.loads(launch.env["VAMP_SGLANG_CONFIG"])["tpot_slo_ms"] == 120.5


def test_staging_defaults_to_auto_is_checked_by_validate_and_travels_to_the_schedulers():
    import json

    assert VampConfig().staging == "auto"
    with pytest.raises(ConfigError, match="--vamp-staging must be one of auto, whole, routed"):
        VampConfig(staging="prefetch").validate()
    launch = launch_server.prepare(MODEL + ["--vamp-staging", "routed"])
    assert json.loads(launch.env["VAMP_SGLANG_CONFIG"])["staging"] == "routed"
    proc = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", *MODEL, "--vamp-staging", "fast"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--vamp-staging" in proc.stderr and "auto" in proc.stderr


def test_defaults_are_the_papers():
    c = VampConfig()
    assert (c.alpha, c.tau_steps, c.t_prefill_us, c.t_sched_us, c.t_queue_us, c.c_reload_ms) == (
        0.5, 2000, 15.0, 500.0, 1000.0, 0.63)
    assert c.max_offload_ratio == 0.15 and c.expand_groups == 4


# --- --nnodes > 1: the rank controller over TCP with CURVE --------------------------------------------
def _two_nodes(key_file, node_rank=1, addr="127.0.0.1:25000"):
    return MODEL + ["--tp-size", "2", "--nnodes", "2", "--node-rank", str(node_rank), "--dist-init-addr", addr,
                    "--vamp-controller-key-file", str(key_file)]


@pytest.fixture
def key_file(tmp_path):
    from vamp_sglang.controller.keys import generate_key_file

    path = tmp_path / "vamp.key"
    generate_key_file(str(path))
    return path


def test_a_key_file_with_mode_0644_is_refused_at_start(key_file):
    key_file.chmod(0o644)
    for argv in (_two_nodes(key_file), MODEL + ["--vamp-controller-key-file", str(key_file)]):
        with pytest.raises(ConfigError, match="--vamp-controller-key-file: key file .* has mode 0644"):
            launch_server.prepare(argv)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", *_two_nodes(key_file)],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "has mode 0644; it must be private (chmod 600" in proc.stderr
    assert time.monotonic() - start < 30, "validation must not wait for SGLang to import"


def test_two_nodes_export_the_controller_endpoint_derived_from_dist_init_addr(key_file):
    import json

    from vamp_sglang import config

    exported = json.loads(launch_server.prepare(_two_nodes(key_file)).env[config.ENV_CONTROLLER_TCP])
    assert exported == {"host": "127.0.0.1", "port": 25007, "key_file": str(key_file)}
    moved = launch_server.prepare(_two_nodes(key_file) + ["--vamp-controller-port", "26001"])
    assert json.loads(moved.env[config.ENV_CONTROLLER_TCP])["port"] == 26001
    for one_node in (MODEL + ["--vamp-controller-key-file", str(key_file)],
                     _two_nodes(key_file) + ["--vamp-max-offload-ratio", "0"]):
        assert config.ENV_CONTROLLER_TCP not in launch_server.prepare(one_node).env  # ipc, or VAMP off


def test_two_nodes_refuse_a_wildcard_host_and_a_taken_port_on_node_0(key_file):
    import socket

    with pytest.raises(ConfigError, match="--dist-init-addr host '0.0.0.0' is a wildcard"):
        launch_server.prepare(_two_nodes(key_file, addr="0.0.0.0:25000"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        dist_port = taken.getsockname()[1] - 7
        with pytest.raises(ConfigError, match="node 0 cannot bind the controller port"):
            launch_server.prepare(_two_nodes(key_file, node_rank=0, addr=f"127.0.0.1:{dist_port}"))
        launch_server.prepare(_two_nodes(key_file, node_rank=1, addr=f"127.0.0.1:{dist_port}"))  # node 1 connects


GPU_PATH_REFUSED = [  # issue 10: graph choices that would replay stale staged experts, and PD disaggregation
    (["--cuda-graph-backend-decode", "full"], "--cuda-graph-backend-decode"),
    (["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill"),
    (["--cuda-graph-config", '{"decode": {"backend": "full", "max_bs": 8}}'], "--cuda-graph-config"),
    (["--cuda-graph-backend-decode", "breakable", "--cuda-graph-config", '{"decode": {"backend": "full"}}'],
     "--cuda-graph-config"),
    (["--enable-torch-compile"], "--enable-torch-compile"),
    (["--enable-torch-compile", "--device", "cpu"], "--enable-torch-compile"),
    (["--disaggregation-mode", "prefill"], "--disaggregation-mode"),
    (["--disaggregation-mode", "decode", "--device", "cpu"], "--disaggregation-mode"),  # on every device
]


@pytest.mark.parametrize("flags,named", GPU_PATH_REFUSED, ids=[" ".join(f) for f, _ in GPU_PATH_REFUSED])
def test_gpu_path_conflicts_are_refused_naming_the_flag(flags, named):
    with pytest.raises(ConfigError, match=named):
        launch_server.prepare(MODEL + ["--vamp-max-offload-ratio", "0.2"] + flags)
    launch_server.prepare(MODEL + ["--vamp-max-offload-ratio", "0"] + flags)  # stock SGLang: its own choice


@pytest.mark.parametrize("flags,added", [
    ([], ["--cuda-graph-backend-decode", "breakable"]),  # VAMP on a GPU: breakable decode graphs
    (["--cuda-graph-backend-decode", "breakable"], []),
    (["--cuda-graph-backend-decode", "disabled"], []),
    (["--disable-cuda-graph"], []),  # the per-phase flag would win over it and turn graphs back on
    (["--disable-decode-cuda-graph"], []),
    (["--cuda-graph-config", '{"decode": {"backend": "breakable"}}'], []),
    (["--cuda-graph-config", '{"decode": {"max_bs": 8}}'], ["--cuda-graph-backend-decode", "breakable"]),
    (["--device", "cpu"], []),
])
def test_decode_graphs_default_to_breakable_with_vamp_on_a_gpu(flags, added):
    launch = launch_server.prepare(MODEL + flags + ["--vamp-max-offload-ratio", "0.2"])
    assert launch.sglang_argv[:len(MODEL) + len(flags) + len(added)] == MODEL + flags + added
    assert launch.sglang_argv.count("--cuda-graph-backend-decode") <= 1
    off = launch_server.prepare(MODEL + flags + ["--vamp-max-offload-ratio", "0"])
    assert "breakable" not in off.sglang_argv[len(MODEL) + len(flags):]


def test_vamp_on_a_hybrid_model_gets_the_state_strategy_it_supports(tmp_path):
    """On a GPU SGLang's `auto` state strategy becomes extra_buffer under the overlap scheduler, which VAMP
    refuses; with VAMP on and no strategy given, the launcher passes no_buffer (and turns the overlap
    scheduler off, as no_buffer requires) instead of letting the scheduler refuse after loading."""
    def model(name, model_type):
        return _model_dir(tmp_path / name, model_type)[:2] + ["--device", "cuda"]

    argv = launch_server.prepare(model("next", "qwen3_next") + ["--vamp-max-offload-ratio", "0.2"]).sglang_argv
    assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "no_buffer"
    assert "--disable-overlap-schedule" in argv
    mine = launch_server.prepare(model("next2", "qwen3_next") + ["--vamp-max-offload-ratio", "0.2",
                                                                  "--mamba-radix-cache-strategy", "no_buffer",
                                                                  "--disable-overlap-schedule"]).sglang_argv
    assert mine.count("--mamba-radix-cache-strategy") == 1 and mine.count("--disable-overlap-schedule") == 1
    stock = launch_server.prepare(model("next3", "qwen3_next") + ["--vamp-max-offload-ratio", "0"]).sglang_argv
    dense = launch_server.prepare(model("moe", "qwen3_moe") + ["--vamp-max-offload-ratio", "0.2"]).sglang_argv
    for other in (stock, dense):
        assert "--mamba-radix-cache-strategy" not in other and "--disable-overlap-schedule" not in other


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_sglang_async_asserts_are_refused_on_a_gpu_with_vamp_on(monkeypatch, value):
    """SGLang's KV out-of-bounds probe compares with the pool size a CUDA graph captured, so it fires on the
    first grown row (review gpu-review-3, defect 10); CPU servers capture no graphs, and VAMP off is stock."""
    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", value)
    with pytest.raises(ConfigError, match=f"SGLANG_ENABLE_ASYNC_ASSERT={value} is not supported"):
        launch_server.prepare(MODEL + ["--vamp-max-offload-ratio", "0.2"])
    assert launch_server.prepare(MODEL + ["--vamp-max-offload-ratio", "0.2", "--device", "cpu"]).vamp.enabled
    assert not launch_server.prepare(MODEL + ["--vamp-max-offload-ratio", "0"]).vamp.enabled
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", *MODEL,
                           "--vamp-max-offload-ratio", "0.2"], check=False, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "SGLANG_ENABLE_ASYNC_ASSERT" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("value", ["0", "false"])
def test_async_asserts_turned_off_are_served(monkeypatch, value):
    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", value)
    assert launch_server.prepare(MODEL + ["--vamp-max-offload-ratio", "0.2"]).vamp.enabled


def test_the_launchers_view_reads_sglang_flags_no_sglang_flag_abbreviates():
    """The launcher reads SGLang's flags with abbreviations allowed; an SGLang flag that is a strict prefix of
    one read here would be taken for it. The refusal modules read only flags SGLang 0.5.23 has."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from vamp_sglang.refusals import attention, experts

    sglang = argparse.ArgumentParser()
    ServerArgs.add_cli_args(sglang)
    theirs = {o for action in sglang._actions for o in action.option_strings if o.startswith("--")}
    ours = {o for action in launch_server.view_parser()._actions for o in action.option_strings}
    assert {(o, s) for o in ours for s in theirs - ours if o.startswith(s)} == set()
    for module in (attention, experts):
        parser = argparse.ArgumentParser(add_help=False)
        module.add_flags(parser)
        assert {o for action in parser._actions for o in action.option_strings} - theirs == set()
