"""VAMP settings: the `--vamp-*` flags, their validation, and how they travel to SGLang's processes.

One frozen dataclass holds every setting. The launcher parses the flags, validates them before
anything is loaded, and exports the result as JSON in one environment variable; SGLang's spawned
scheduler processes inherit the environment and read it back with `VampConfig.from_env()`.
Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass

ENV_ENABLE = "VAMP_SGLANG_ENABLE"  # "1" only when our launcher started this process tree
ENV_CONFIG = "VAMP_SGLANG_CONFIG"  # the VampConfig as JSON
ENV_CONTROL_DIR = "VAMP_SGLANG_CONTROL_DIR"  # private 0700 directory for the controller's ipc sockets
ENV_FAULT = "VAMP_SGLANG_FAULT"  # fault injection for tests and soak runs (vamp_sglang/faults.py)
ENV_CONTROLLER_TCP = "VAMP_SGLANG_CONTROLLER_TCP"  # --nnodes > 1: {"host", "port", "key_file"} as JSON

POLICIES = ("cost", "evict-first", "offload-first")
PAGE_BACKENDS = ("auto", "cuda", "host")
STAGING = ("auto", "whole", "routed", "host")  # memory/staging_choice.py (issue 12)
EXPERT_ORDERS = ("index", "routing")  # memory/residency.py: which experts an offload takes (issue 49)
TREE_CORES = ("auto", "python", "rust")  # integration/cache/radix_backend.py: which SGLang tree core carries VAMP's order


class ConfigError(ValueError):
    """A bad flag value or combination; the message names the flag."""


@dataclass(frozen=True)
class VampConfig:
    """Every VAMP setting. Defaults are the paper's section V values (ratio: VAMP-15)."""

    max_offload_ratio: float = 0.15  # fraction of each eligible layer's experts that may leave; 0 = off
    policy: str = "cost"  # cost (paper IV-B) or an ablation policy
    alpha: float = 0.5  # reuse weight in p_eff (Eq. 1)
    tau_steps: int = 2000  # age scale of p_eff, in scheduler steps (Eq. 1)
    t_prefill_us: float = 15.0  # re-prefill time per token (Eqs. 2, 4)
    t_sched_us: float = 500.0  # scheduling overhead of a preemption (Eq. 4)
    t_queue_us: float = 1000.0  # initial queueing delay of a preempted request (Eq. 4)
    c_reload_ms: float = 0.63  # per-group reload weight; c_eff = c_reload * k / E (Eq. 3)
    expand_groups: int = 4  # offload in steps of this many groups (section V-A)
    restore_after_steps: int = 2000  # restore experts after this many low-pressure steps; 0 = never
    page_backend: str = "auto"  # auto, cuda (driver VMM) or host (memfd pages)
    initial_offload_ratio: float = 0.0  # offload this fraction at start-up (benchmarks, output checks)
    calibrate: bool = True  # measure t_prefill and staging cost online instead of fixed values
    decision_log: str | None = None  # JSONL file that every decision is appended to
    controller_port: int = 0  # --nnodes > 1: the rank controller's TCP port; 0 = --dist-init-addr port + 7
    controller_key_file: str | None = None  # --nnodes > 1: the deployment's CURVE key pair (mode 0600)
    tpot_slo_ms: float | None = None  # TPOT SLO: no offload projected past it (policy/tpot_guard); None: off
    staging: str = "auto"  # whole-region prefetch (paper IV-D), routed-only copies, or a per-step choice
    expert_order: str = "index"  # offload the highest-index experts (paper IV-C), or the least routed
    tree_core: str = "auto"  # SGLang's Rust tree core where it can carry VAMP's order (auto), or its Python core

    @property
    def enabled(self) -> bool:
        """VAMP repartitions memory only with a positive ratio; 0 is stock SGLang."""
        return self.max_offload_ratio > 0

    def validate(self) -> VampConfig:
        checks = [
            (0.0 <= self.max_offload_ratio < 1.0, "--vamp-max-offload-ratio must be in [0, 1)"),
            (self.policy in POLICIES, f"--vamp-policy must be one of {', '.join(POLICIES)}"),
            (0.0 < self.alpha <= 1.0, "--vamp-alpha must be in (0, 1]"),
            (self.tau_steps > 0, "--vamp-tau-steps must be a positive integer"),
            (self.t_prefill_us > 0, "--vamp-t-prefill-us must be positive"),
            (self.t_sched_us >= 0, "--vamp-t-sched-us must be >= 0"),
            (self.t_queue_us >= 0, "--vamp-t-queue-us must be >= 0"),
            (self.c_reload_ms >= 0, "--vamp-c-reload-ms must be >= 0"),
            (self.expand_groups >= 1, "--vamp-expand-groups must be >= 1"),
            (self.restore_after_steps >= 0, "--vamp-restore-after-steps must be >= 0"),
            (0.0 <= self.initial_offload_ratio <= self.max_offload_ratio,
             "--vamp-initial-offload-ratio must be in [0, --vamp-max-offload-ratio]"),
            (self.page_backend in PAGE_BACKENDS,
             f"--vamp-page-backend must be one of {', '.join(PAGE_BACKENDS)}"),
            (0 <= self.controller_port <= 65535, "--vamp-controller-port must be in [0, 65535] (0: dist-init + 7)"),
            (self.staging in STAGING, f"--vamp-staging must be one of {', '.join(STAGING)}"),
            (self.tree_core in TREE_CORES, f"--vamp-tree-core must be one of {', '.join(TREE_CORES)}"),
            (self.expert_order in EXPERT_ORDERS, f"--vamp-expert-order must be one of {', '.join(EXPERT_ORDERS)}"),
            (self.tpot_slo_ms is None or (math.isfinite(self.tpot_slo_ms) and self.tpot_slo_ms > 0),
             "--vamp-tpot-slo-ms must be a positive finite number of milliseconds"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"{message} (got {self._value_for(message)!r})")
        for name in ("alpha", "t_prefill_us", "t_sched_us", "t_queue_us", "c_reload_ms", "max_offload_ratio",
                     "initial_offload_ratio"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ConfigError(f"--vamp-{name.replace('_', '-')} must be a finite number (got {value!r})")
        return self

    def _value_for(self, message: str) -> object:
        flag = message.split()[0]
        return getattr(self, flag.removeprefix("--vamp-").replace("-", "_"))

    # --- transport to SGLang's processes -------------------------------------------------------
    def to_env(self) -> dict[str, str]:
        return {ENV_ENABLE: "1", ENV_CONFIG: json.dumps(dataclasses.asdict(self), sort_keys=True)}

    @classmethod
    def from_env(cls) -> VampConfig | None:
        """The config our launcher exported, or None when this process tree is plain SGLang."""
        if os.environ.get(ENV_ENABLE) != "1":
            return None
        return cls(**json.loads(os.environ[ENV_CONFIG])).validate()


def plugin_enabled() -> bool:
    return os.environ.get(ENV_ENABLE) == "1"


def fault_spec() -> str | None:
    return os.environ.get(ENV_FAULT)


def control_dir() -> str | None:
    return os.environ.get(ENV_CONTROL_DIR)


def controller_tcp() -> tuple[str, int, str] | None:
    """(host, port, key_file) of the rank controller when the launcher chose TCP (--nnodes > 1)."""
    raw = os.environ.get(ENV_CONTROLLER_TCP)
    if raw is None:
        return None
    link = json.loads(raw)
    return str(link["host"]), int(link["port"]), str(link["key_file"])


def controller_tcp_env(host: str, port: int, key_file: str) -> dict[str, str]:
    """What the launcher exports so that `controller_tcp()` reads it back in every scheduler."""
    return {ENV_CONTROLLER_TCP: json.dumps({"host": host, "port": port, "key_file": key_file})}


# --- command-line flags --------------------------------------------------------------------------
def _flag(field: str) -> str:
    return "--vamp-" + field.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add every `--vamp-*` flag; defaults come from VampConfig so there is one source of truth."""
    defaults = VampConfig()
    group = parser.add_argument_group("VAMP (expert memory becomes KV memory)")
    for field in dataclasses.fields(VampConfig):
        default = getattr(defaults, field.name)
        if field.name == "calibrate":
            group.add_argument("--vamp-no-calibrate", dest="vamp_calibrate", action="store_false",
                               help="use the fixed --vamp-t-* coefficients instead of online measurements")
            continue
        kind = {"float": float, "int": int, "float | None": float}.get(str(field.type), str)
        kwargs = {"dest": "vamp_" + field.name, "type": kind, "default": default, "help": f"(default: {default})"}
        if field.name == "policy":
            kwargs["choices"] = POLICIES
        if field.name == "page_backend":
            kwargs["choices"] = PAGE_BACKENDS
        if field.name == "staging":
            kwargs["choices"] = STAGING
        if field.name == "tree_core":
            kwargs["choices"] = TREE_CORES
        if field.name == "expert_order":
            kwargs["choices"] = EXPERT_ORDERS
        group.add_argument(_flag(field.name), **kwargs)


def from_cli_args(args: argparse.Namespace) -> VampConfig:
    values = {f.name: getattr(args, "vamp_" + f.name) for f in dataclasses.fields(VampConfig)}
    return VampConfig(**values).validate()
