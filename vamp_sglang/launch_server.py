"""`python -m vamp_sglang.launch_server [sglang flags] [--vamp-* flags]`: SGLang's server with VAMP.

A drop-in for `python -m sglang.launch_server`. Every bad `--vamp-*` value or flag combination is
refused here, in about a second, before SGLang (a 10 s import) or the model is loaded. The
validated settings then travel to every process SGLang spawns through the environment, where our
plugin (entry point `sglang.srt.plugins`) reads them; without this launcher the plugin stays inert.
With `--device cpu` the launcher also prepares SGLang's CPU mode (see `vamp_sglang.cpu`).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
from dataclasses import dataclass

from vamp_sglang import config
from vamp_sglang.config import ConfigError, VampConfig
from vamp_sglang.cpu import hybrid_model
from vamp_sglang.faults import Faults, FaultSpecError
from vamp_sglang.integration import gpu_flags
from vamp_sglang.refusals import attention as attention_refusals
from vamp_sglang.refusals import experts as expert_refusals
from vamp_sglang.refusals import families as family_refusals
from vamp_sglang.refusals import hicache as hicache_refusals
from vamp_sglang.refusals import hybrid as hybrid_refusals
from vamp_sglang.refusals import mla as mla_refusals
from vamp_sglang.refusals import speculative as speculative_refusals

PROG = "python -m vamp_sglang.launch_server"

_SPECULATIVE = "--speculative-algorithm"
# SGLang features VAMP cannot serve, refused when VAMP is on: flag -> why ("": layout not handled yet).
_UNSUPPORTED_WITH_VAMP = {
    "--enable-paged-experts": "",
    "--enable-pdmux": "split prefill runs one forward per layer chunk, and each restarts expert staging "
                      "into a slot whose copy for a later layer is still pending: wrong expert weights",
    "--enable-nvidia-megakernel": "its kernels are built from the expert weights before VAMP pages them, "
                                  "and keep the originals VAMP frees",
}
# SGLang 0.5.23 turns a `--config` YAML into `--key value` flags ahead of the command line
# (server_args.py prepare_server_args; utils/server_args_config_parser.py _convert_config_to_args).
_CONFIG_FILE = "--config"


@dataclass(frozen=True)
class Launch:
    """What the launcher hands to SGLang: our config, SGLang's argv, and the env to export."""

    vamp: VampConfig
    sglang_argv: list[str]
    env: dict[str, str]
    device: str
    tp_size: int


def _config_file_flags(argv: list[str]) -> list[str]:
    """The scalar and true-boolean flags a `--config` YAML gives SGLang, so a refused feature switched on there
    is refused too. A file SGLang cannot read gives none here: SGLang reports it."""
    if _CONFIG_FILE not in argv[:-1]:
        return []
    import yaml

    try:
        with open(argv[argv.index(_CONFIG_FILE) + 1]) as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return []
    flags: list[str] = []
    for key, value in (values if isinstance(values, dict) else {}).items():
        if value is True or not isinstance(value, (bool, list, dict)):
            flags += [f"--{key}"] + ([] if value is True else [str(value)])
    return flags


def view_parser() -> argparse.ArgumentParser:
    """The few SGLang flags our checks depend on, read without importing SGLang, taking the unique
    abbreviations SGLang's parser takes (no SGLang flag is a prefix of one read here, so none is mistaken for
    another: tests/test_launcher_validation.py checks it against SGLang's parser)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device", default=None)
    p.add_argument("--model-path", "--model", dest="model_path", default=None)
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--pp-size", "--pp", dest="pp_size", type=int, default=1)
    p.add_argument("--ep-size", "--ep", dest="ep_size", type=int, default=1)
    p.add_argument("--dwdp-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")  # served: one round group per DP rank
    p.add_argument("--radix-cache-backend", default=None)
    p.add_argument("--radix-eviction-policy", default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", "--nccl-init-addr", dest="dist_init_addr", default=None)
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument("--enable-session-radix-cache", action="store_true")
    for flag in _UNSUPPORTED_WITH_VAMP:
        p.add_argument(flag, action="store_true")
    hybrid_refusals.add_flags(p)  # with _SPECULATIVE
    mla_refusals.add_flags(p)
    speculative_refusals.add_flags(p)
    p.add_argument(hicache_refusals.HICACHE, action="store_true")
    hicache_refusals.add_flags(p)
    attention_refusals.add_flags(p)
    expert_refusals.add_flags(p)
    return p


def _sglang_view(argv: list[str]) -> argparse.Namespace:
    """SGLang's flags from a `--config` file and the command line (which wins)."""
    return view_parser().parse_known_args(_config_file_flags(argv) + argv)[0]


def _turns_on(sg: argparse.Namespace, flag: str) -> bool:
    """Whether the flags turn on `flag`'s feature. Speculative decoding counts when it builds a draft KV pool:
    not NGRAM (SGLang's `has_draft_kv`), nor an algorithm that only names the aux hidden-state capture."""
    if flag == _SPECULATIVE:
        algorithm = (sg.speculative_algorithm or "").upper()
        return algorithm not in ("", "NGRAM") and not sg.enable_return_aux_hidden_states
    return getattr(sg, flag.removeprefix("--").replace("-", "_"))


def check_combinations(vamp: VampConfig, sg: argparse.Namespace) -> None:
    """Refuse flag combinations VAMP cannot serve, naming the flags."""
    device = sg.device or "cuda"
    if vamp.page_backend == "cuda" and device != "cuda":
        raise ConfigError(f"--vamp-page-backend cuda needs --device cuda (got --device {device})")
    if vamp.staging == "host" and device == "cuda" and sg.moe_runner_backend not in (None, "auto", "triton"):
        raise ConfigError(f"--vamp-staging host on a GPU needs SGLang's Triton MoE runner, which skips the -1 ids "
                          f"of the host's slots (got --moe-runner-backend {sg.moe_runner_backend}): use auto, "
                          f"whole or routed staging")  # integration/staging/host_experts_cuda.py
    if vamp.page_backend == "host" and device == "cuda":
        raise ConfigError("--vamp-page-backend host is for --device cpu; use cuda or auto on a GPU")
    if vamp.expert_order == "routing" and sg.moe_runner_backend not in (None, "auto", "triton"):
        raise ConfigError(f"--vamp-expert-order routing needs SGLang's Triton MoE runner (got "
                          f"--moe-runner-backend {sg.moe_runner_backend}, whose per-expert copies a row swap "
                          f"would not move): use --vamp-expert-order index")
    if sg.radix_eviction_policy == "vamp" and sg.radix_cache_backend != "vamp":
        raise ConfigError("--radix-eviction-policy vamp needs --radix-cache-backend vamp")
    if vamp.decision_log is not None:
        parent = os.path.dirname(os.path.abspath(vamp.decision_log))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError(f"--vamp-decision-log: directory {parent} does not exist or is not writable")
    served_draft = _turns_on(sg, _SPECULATIVE) and not speculative_refusals.refused_with_vamp(sg.speculative_algorithm)
    if refusal := hicache_refusals.refused(sg, vamp.enabled, hybrid_model.is_hybrid_linear(sg.model_path),
                                          served_draft):  # a draft VAMP never serves is refused for itself below
        raise ConfigError(refusal)
    if refusal := speculative_refusals.refused(sg):  # CPU mode's draft chains, with VAMP on or off
        raise ConfigError(refusal)
    if vamp.tree_core == "rust":  # what SGLang's Rust core cannot hold under VAMP's order (radix_rust.refusal)
        held = [flag for flag in ("--enable-session-radix-cache", "--enable-hierarchical-cache")
                if getattr(sg, flag.removeprefix("--").replace("-", "_"))]
        held += ["a hybrid linear-attention model"] if hybrid_model.is_hybrid_linear(sg.model_path) else []
        if held:
            raise ConfigError(f"--vamp-tree-core rust cannot hold {', '.join(held)}: use auto or python")
    if not vamp.enabled:
        return
    if sg.disable_radix_cache:
        raise ConfigError("--disable-radix-cache leaves VAMP no decision point (SGLang's prefix-cache eviction "
                          "funnel); drop it or set --vamp-max-offload-ratio 0")
    if sg.radix_cache_backend not in (None, "vamp"):
        raise ConfigError(
            f"--vamp-max-offload-ratio > 0 needs our radix tree for its cost estimates; "
            f"drop --radix-cache-backend {sg.radix_cache_backend} or set --vamp-max-offload-ratio 0"
        )
    for name, flag in [("pp_size", "--pp-size"), ("dwdp_size", "--dwdp-size")]:  # --ep-size: the dispatcher decides
        if getattr(sg, name) != 1:
            raise ConfigError(f"{flag} > 1 is not supported with --vamp-max-offload-ratio > 0")
    for flag, why in _UNSUPPORTED_WITH_VAMP.items():
        if _turns_on(sg, flag):
            raise ConfigError(f"{flag} is not supported with --vamp-max-offload-ratio > 0" + (f" ({why})" if why else ""))
    if _turns_on(sg, _SPECULATIVE) and (why := speculative_refusals.refused_with_vamp(sg.speculative_algorithm)):
        raise ConfigError(f"{_SPECULATIVE} {sg.speculative_algorithm} is not supported with "
                          f"--vamp-max-offload-ratio > 0 ({why})")
    if _turns_on(sg, _SPECULATIVE) and (refusal := speculative_refusals.draft_row_refused(sg)):
        raise ConfigError(refusal)
    if hybrid_model.is_hybrid_linear(sg.model_path) and (refusal := hybrid_refusals.refused_by_flags(sg)):
        raise ConfigError(refusal)
    for refusal in (family_refusals.refused(sg), mla_refusals.refused(sg), attention_refusals.refused(sg),
                    expert_refusals.refused(sg),
                    gpu_flags.environment_refusal(os.environ, sg.device or "cuda")):
        if refusal:
            raise ConfigError(refusal)


def _with_vamp_tree(vamp: VampConfig, sg: argparse.Namespace, argv: list[str]) -> list[str]:
    """VAMP's planner reads eviction costs from our radix tree, so VAMP on means our tree."""
    if not vamp.enabled or sg.radix_cache_backend == "vamp":
        return argv
    return argv + ["--radix-cache-backend", "vamp", "--radix-eviction-policy", "vamp"]


def _with_defaults(argv: list[str], defaults: list[str]) -> list[str]:
    """Append each default flag (with its values) unless the user already gave that flag."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out, keep = list(argv), False
    for token in defaults:
        if token.startswith("--"):
            keep = token not in given
        if keep:
            out.append(token)
    return out


def prepare(argv: list[str]) -> Launch:
    """Parse and validate everything; no SGLang import, no side effects."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    config.add_cli_args(parser)
    ns, rest = parser.parse_known_args(argv)
    vamp = config.from_cli_args(ns)
    try:
        Faults.parse(config.fault_spec())
    except FaultSpecError as e:
        raise ConfigError(str(e)) from None
    sg = _sglang_view(rest)
    if sg.tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1 (got {sg.tp_size})")
    check_combinations(vamp, sg)
    sglang_argv = _with_vamp_tree(vamp, sg, gpu_flags.with_staging_graphs(rest, sg.device or "cuda")
                                  if vamp.enabled else rest)
    if vamp.enabled and hybrid_model.is_hybrid_linear(sg.model_path):
        sglang_argv = _with_defaults(sglang_argv, hybrid_refusals.vamp_defaults())
    from vamp_sglang.controller.multinode import controller_env

    env = vamp.to_env() | controller_env(vamp, sg)  # TCP for the rank controller when --nnodes > 1
    device = sg.device or "cuda"
    if device == "cpu":
        from vamp_sglang import cpu

        env.update(cpu.cpu_environment(sg.tp_size * sg.pp_size))  # every stage's ranks need a core entry
        sglang_argv = _with_defaults(sglang_argv, cpu.cpu_server_defaults(sg.model_path) + hicache_refusals.cpu_defaults(sg))
        if hybrid_model.is_hybrid_linear(sg.model_path):  # Qwen3-Next: the flags its CPU path needs
            env.update(hybrid_model.hybrid_cpu_environment(os.environ))
            sglang_argv = _with_defaults(sglang_argv, hybrid_model.hybrid_cpu_defaults())
    return Launch(vamp, sglang_argv, env, device, sg.tp_size)


def _print_help() -> None:
    parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    config.add_cli_args(parser)
    print(f"usage: {PROG} [every sglang.launch_server flag] [--vamp-* flags]\n")
    print(parser.format_help())
    print("SGLang's own flags follow.\n", flush=True)


def _export(launch: Launch) -> None:
    """Apply the environment here; SGLang's spawned processes inherit it."""
    os.environ.update(launch.env)
    from vamp_sglang.controller import make_private_ipc_dir

    if config.ENV_CONTROLLER_TCP not in launch.env:  # one node: the ranks meet in a private ipc dir
        control_dir = make_private_ipc_dir()
        os.environ[config.ENV_CONTROL_DIR] = control_dir
        atexit.register(shutil.rmtree, control_dir, True)
    for path in reversed(launch.env.get("PYTHONPATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(0, path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        _print_help()
        argv = ["--help"]
    else:
        try:
            launch = prepare(argv)
        except ConfigError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            sys.exit(2)
        _export(launch)
        argv = launch.sglang_argv

    # Heavy imports only after validation, and after the environment is in place.
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints import http_server  # noqa: F401  (the plugin adds /vamp/stats to its app)
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
