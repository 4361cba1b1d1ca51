"""The launcher's choice of controller transport, made and checked before SGLang loads.

One node: ipc in a private directory, as before. `--nnodes > 1` with VAMP on: TCP with CURVE,
which needs `--dist-init-addr` (every node derives the leader's endpoint from it) and
`--vamp-controller-key-file`. Everything that can be wrong is refused here, naming the flag:
a missing or unsafe key file (group- or world-readable), a wildcard host, a port past 65535, and on
node 0 a controller port that is already taken. Without these checks the ranks on different nodes
would silently never agree and every KV shortfall would wait out both time-outs.
"""

import argparse
import os
from collections.abc import Callable

from vamp_sglang import config
from vamp_sglang.config import ConfigError, VampConfig
from vamp_sglang.controller.ipc import ControllerError
from vamp_sglang.controller.keys import check_key_file, load_key_file
from vamp_sglang.controller.tcp import check_port_free, leader_endpoint


def controller_env(vamp: VampConfig, sg: argparse.Namespace) -> dict[str, str]:
    """The environment that makes `RankController.from_env` use TCP, or {} for ipc.

    `sg` carries SGLang's `nnodes`, `node_rank`, `tp_size` and `dist_init_addr` flags.
    """
    key_file = vamp.controller_key_file
    if key_file is not None:
        _checked(check_key_file, key_file)  # refused even where unused: an unsafe key is never fine
    if not vamp.enabled or sg.nnodes == 1:
        return {}
    _check_topology(sg)
    if key_file is None:
        raise ConfigError("--nnodes > 1 with VAMP on needs --vamp-controller-key-file (the same file on "
                          "every node; make one with `python -m vamp_sglang.controller keygen PATH`)")
    _checked(load_key_file, key_file)
    try:
        endpoint = leader_endpoint(sg.dist_init_addr, vamp.controller_port)
        if sg.node_rank == 0:
            check_port_free(endpoint)
    except ControllerError as exc:
        raise ConfigError(str(exc)) from None
    return config.controller_tcp_env(endpoint.host, endpoint.port, os.path.abspath(key_file))


def _checked(check: Callable[[str], object], key_file: str) -> None:
    try:
        check(key_file)
    except ControllerError as exc:
        raise ConfigError(f"--vamp-controller-key-file: {exc}") from None

def _check_topology(sg: argparse.Namespace) -> None:
    if sg.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1 (got {sg.nnodes})")
    if not 0 <= sg.node_rank < sg.nnodes:
        raise ConfigError(f"--node-rank must be in [0, --nnodes {sg.nnodes}) (got {sg.node_rank})")
    if sg.tp_size % sg.nnodes:
        raise ConfigError(f"--tp-size {sg.tp_size} must be a multiple of --nnodes {sg.nnodes}")
    _check_dp_leaders(sg)
    if sg.dist_init_addr is None:
        raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (the same on every node); without "
                          "it the nodes never meet and VAMP's ranks cannot agree")


def attention_dp_size(sg: argparse.Namespace) -> int:
    """The DP-attention ranks the flags ask for: `--attn-dp-size` (SGLang 0.5.23's spelling), else the deprecated
    `--enable-dp-attention` with `--dp-size` (arg_groups/parallel_hook.py); 1 without DP attention."""
    if getattr(sg, "attn_dp_size", 1) > 1:
        return sg.attn_dp_size
    return getattr(sg, "dp_size", 1) if getattr(sg, "enable_dp_attention", False) else 1


def _check_dp_leaders(sg: argparse.Namespace) -> None:
    """Under DP attention each DP rank's attention-TP rank 0 leads its group's round (controller/groups.py), and a
    leader binds on --dist-init-addr's host, node 0's: a group whose leader lives on another node could not
    bind. With attention-TP 1 there is no round, so nothing is refused."""
    dp = attention_dp_size(sg)
    if dp <= 1 or sg.tp_size % dp or sg.tp_size // dp == 1:
        return
    attn_tp, per_node = sg.tp_size // dp, sg.tp_size // sg.nnodes
    remote = [g for g in range(dp) if g * attn_tp // per_node != 0]
    if remote:
        given = "--attn-dp-size" if getattr(sg, "attn_dp_size", 1) > 1 else "--enable-dp-attention --dp-size"
        raise ConfigError(f"{given} {dp} with --nnodes {sg.nnodes} puts DP rank {remote[0]}'s "
                          f"controller leader (attention-TP rank 0, TP rank {remote[0] * attn_tp}) on node "
                          f"{remote[0] * attn_tp // per_node}, where it cannot bind the controller endpoint on node 0; "
                          f"use {given.split()[-1]} {sg.tp_size} (attention-TP 1: no rounds) or one node")
