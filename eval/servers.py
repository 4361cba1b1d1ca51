"""Start and stop our server (`python -m vamp_sglang.launch_server`) for one configuration at a time.

A server gets a free loopback port, its own process group (so stopping it kills SGLang's scheduler
and detokenizer too) and a log file. Servers on this machine are serialised through one lock file
(/tmp/vamp-server.lock, as for every engineer's server), held while the server lives.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self

LOCK_PATH = os.environ.get("VAMP_SERVER_LOCK", "/tmp/vamp-server.lock")  # "" disables the lock
ALWAYS_FLAGS = ("--enable-metrics", "--enable-cache-report")  # the bench reads these counters


@dataclass(frozen=True)
class ServerConfig:
    """One configuration under test: a name for tables and the flags that make it (`--vamp-*` and SGLang's)."""

    name: str
    flags: tuple[str, ...] = ()
    plain_sglang: bool = False  # `python -m sglang.launch_server` itself: no VAMP plugin, no --vamp-* flags
    env: tuple[tuple[str, str], ...] = ()  # extra environment, e.g. (("VAMP_SGLANG_FAULT", "remap:1"),)


@dataclass(frozen=True)
class ServerSetup:
    """What every configuration of one experiment shares."""

    model_path: str
    device: str = "cpu"
    max_total_tokens: int = 4096
    tp_size: int = 1
    extra_flags: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    log_dir: str = "results/logs"


class ServerError(RuntimeError):
    """The server did not become healthy; the message carries the tail of its log."""


class PortTaken(ServerError):
    """The HTTP port was free when picked but taken before the server bound it (SGLang's own processes pick
    free ports for their sockets too, and one can land on ours); the server then hangs instead of exiting."""


PORT_ATTEMPTS = 3
_PORT_TAKEN = "error while attempting to bind on address"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(setup: ServerSetup, config: ServerConfig) -> dict[str, str]:
    """The server's environment; plain SGLang on CPU gets by hand what our launcher sets up for it."""
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} | dict(config.env)
    if config.plain_sglang and setup.device == "cpu":
        from vamp_sglang.cpu import cpu_environment

        env |= cpu_environment(setup.tp_size, env)
    return env


def launch_argv(setup: ServerSetup, config: ServerConfig, port: int) -> list[str]:
    launcher = "sglang.launch_server" if config.plain_sglang else "vamp_sglang.launch_server"
    argv = [sys.executable, "-m", launcher, "--model-path", setup.model_path,
            "--device", setup.device, "--host", "127.0.0.1", "--port", str(port),
            "--max-total-tokens", str(setup.max_total_tokens)]
    if setup.tp_size != 1:
        argv += ["--tp-size", str(setup.tp_size)]
    given = set(setup.extra_flags) | set(config.flags)
    argv += [f for f in ALWAYS_FLAGS if f not in given] + list(setup.extra_flags) + list(config.flags)
    if config.plain_sglang and setup.device == "cpu":
        from vamp_sglang.cpu import cpu_server_defaults

        argv += cpu_server_defaults(setup.model_path)
    return argv


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Server:
    """A running server; use as a context manager so it is always stopped."""

    setup: ServerSetup
    config: ServerConfig
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    _lock: IO | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _acquire_lock(self) -> None:
        if not LOCK_PATH:
            return
        self._lock = open(LOCK_PATH, "a+")  # noqa: SIM115  (held for the server's lifetime)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {LOCK_PATH} (another server is running)", file=sys.stderr, flush=True)
            fcntl.flock(self._lock, fcntl.LOCK_EX)

    def start(self) -> Server:
        """Launch and wait until healthy; a port taken under us is retried on a fresh one."""
        for attempt in range(PORT_ATTEMPTS):
            self._acquire_lock()
            try:
                self._launch()
                return self
            except PortTaken:
                self.stop()
                if attempt == PORT_ATTEMPTS - 1:
                    raise
                print(f"port {self.port} was taken while {self.config.name!r} started; retrying on another",
                      file=sys.stderr, flush=True)
                self.port = free_port()
            except BaseException:
                self.stop()
                raise
        return self  # not reached: the last attempt returns or raises

    def _launch(self) -> None:
        log_dir = Path(self.setup.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{self.config.name}-{self.port}.log"
        env = launch_env(self.setup, self.config)
        argv = launch_argv(self.setup, self.config, self.port)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(argv) + "\n")
            log.flush()
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.setup.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"server {self.config.name!r} exited with code {self.process.returncode}; "
                                  f"log {self.log_path}:\n{_log_tail(self.log_path)}")
            if _PORT_TAKEN in _log_tail(self.log_path):
                raise PortTaken(f"server {self.config.name!r}: port {self.port} taken; log {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise ServerError(f"server {self.config.name!r} not healthy after {self.setup.startup_timeout_s:.0f} s; "
                          f"log {self.log_path}:\n{_log_tail(self.log_path)}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `grace_s`, release the lock."""
        if self.process is not None and self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:
            self._signal_group(signal.SIGKILL)  # children outlive a parent that exited on SIGTERM
            self.process.wait()
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ensure_tiny_model(path: str | Path) -> Path:
    """The tiny Qwen3-MoE model for CPU runs, generated once by `python -m vamp_sglang.tiny_moe OUT_DIR`."""
    path = Path(path)
    if not (path / "config.json").is_file():
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "vamp_sglang.tiny_moe", str(path)], check=True, env=env)
    return path


def get_json(url: str, timeout_s: float = 60.0) -> dict:
    """GET a JSON endpoint of a running server (`/vamp/stats`, `/server_info`)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    """POST a JSON body (e.g. a non-streaming `/generate`) and return the JSON answer."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as response:
        return json.loads(response.read())
