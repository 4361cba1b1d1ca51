"""The launcher serves DP attention with VAMP on (each DP rank's attention-TP group holds its own rounds,
controller/groups.py), and hands SGLang the flags unchanged."""

from vamp_sglang import launch_server

MODEL = ["--model-path", "models/tiny-qwen3-moe", "--device", "cpu"]


def test_dp_attention_with_vamp_on_is_served():
    argv = [*MODEL, "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--vamp-max-offload-ratio", "0.2"]
    launch = launch_server.prepare(argv)
    assert launch.vamp.enabled
    flags = launch.sglang_argv
    assert flags[flags.index("--dp-size") + 1] == "2" and "--enable-dp-attention" in flags
