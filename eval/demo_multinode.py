"""`python -m eval.demo_multinode` (make demo-multinode): VAMP with TP 2 split over two "nodes" on loopback.

Node 0 and node 1 are two `python -m vamp_sglang.launch_server --nnodes 2 --node-rank {0,1}` launchers
on this machine, one TP rank each, meeting at `--dist-init-addr 127.0.0.1:D`; the rank controller runs
over TCP with CURVE (leader on 127.0.0.1:D+7, one key file made by `python -m vamp_sglang.controller
keygen`). The same multi-turn workload as `make demo` (past the KV cliff of a 2048-token pool) runs
against single-node TP 1, single-node TP 2 and the two nodes. Exit 0 only if, on the two nodes,
offload decisions happened (which needs both ranks to agree over TCP), both ranks logged identical
decisions and pool sizes, and the greedy outputs equal those of single-node TP 2 and of TP 1.

Caveat: both "nodes" share one kernel, so SGLang sends TP 1 its requests through /dev/shm and its own
cross-host broadcast path is not exercised; the controller's TCP + CURVE path is.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import random
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eval import servers
from eval.bench import BenchSpec, run_bench
from eval.demo import add_demo_args, demo_spec
from eval.replay import ReplayOptions
from eval.runners import TINY_MODEL
from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model
from vamp_sglang.controller.keys import generate_key_file
from vamp_sglang.controller.tcp import PORT_OFFSET

OFFLOADS = ("offload", "combined")


class _Node(Server):
    """One node's launcher. The deployment holds the server lock for both nodes, and node 1 is not
    waited for at start: SGLang brings up its health server only once node 0 has joined."""

    wait_at_start: bool = True

    def _acquire_lock(self) -> None:
        return

    def _wait_healthy(self) -> None:
        if self.wait_at_start:
            super()._wait_healthy()


@contextmanager
def _server_slot() -> Iterator[None]:
    """Both nodes count as one server against /tmp/vamp-server.lock (eval.servers.LOCK_PATH)."""
    if not servers.LOCK_PATH:
        yield
        return
    with open(servers.LOCK_PATH, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while any other server runs
        yield


def _dist_init_port() -> int:
    """D and D + 7 free, below the ephemeral range (32768+) so nothing random takes them meanwhile."""
    for _ in range(100):
        port = random.randrange(20000, 32000 - PORT_OFFSET)
        try:
            for p in (port, port + PORT_OFFSET):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free dist-init port pair in [20000, 32000)")


def listeners(pgid: int) -> list[str]:
    """`address:port` of every listening TCP socket of process group `pgid`, read from /proc."""
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # the process or fd went away meanwhile
            continue
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1], v6))
    return sorted(set(found), key=lambda a: int(a.rsplit(":", 1)[1]))


def _address(hex_addr: str, v6: bool) -> str:
    host_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(host_hex)
    if v6:  # four little-endian 32-bit words
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{int(port_hex, 16)}"
    return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port_hex, 16)}"


def _decisions(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _per_rank(log: Path) -> list[list[dict]]:
    return [_decisions(log), _decisions(Path(f"{log}.rank1"))]


def _digest(decisions: list[dict]) -> list[tuple]:
    """What two ranks must agree on: when, what, how many tokens, and the pool size after."""
    return [(d["step"], d["plan"]["action"], d["outcome"].get("tokens_added", 0), d["outcome"]["pool_tokens"])
            for d in decisions]


def _run(setup: ServerSetup, config: ServerConfig, spec: BenchSpec) -> dict:
    with Server(setup, config) as server:
        return asyncio.run(run_bench(spec, ReplayOptions(server.url)))


def run_two_nodes(setup: ServerSetup, flags: tuple[str, ...], key_files: tuple[str, str],
                  spec: BenchSpec) -> tuple[dict, dict]:
    """The workload against node 0 of a two-node deployment; node r gets key_files[r] (the same file, or another
    one to show a rejected node). Returns the bench result and what the network looked like."""
    dist_port = _dist_init_port()
    common = (*flags, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{dist_port}")
    node1, node0 = (_Node(setup, ServerConfig(f"node{r}", (*common, "--node-rank", str(r),
                                                          "--vamp-controller-key-file", key_files[r])))
                    for r in (1, 0))
    node1.wait_at_start = False
    with _server_slot():
        try:
            node1.start()
            node0.start()
            Server._wait_healthy(node1)  # node 1's health server is up once both nodes joined
            ports = {"dist_init": dist_port, "controller": dist_port + PORT_OFFSET, "http_node0": node0.port,
                     "health_node1": node1.port}
            result = asyncio.run(run_bench(spec, ReplayOptions(node0.url)))
            bound = {"node0": listeners(node0.process.pid), "node1": listeners(node1.process.pid)}
        finally:
            node0.stop()  # its ShutdownReq stops node 1's scheduler too
            node1.stop()
    logged = {name: node.log_path.read_text(errors="replace").splitlines() for name, node in (("0", node0), ("1", node1))}
    return result, {"ports": ports, "listening": bound,
                    "rejected_on_node0": [x for x in logged["0"] if "vamp controller: rank 0 rejected" in x],
                    "refused_on_node1": [x for x in logged["1"] if "handshakes with the leader" in x
                                         or "handshake with the leader" in x],
                    "timed_out_on_node0": [x for x in logged["0"] if "did not answer round" in x]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.demo_multinode", description=__doc__.splitlines()[0])
    add_demo_args(parser, "results/demo-multinode")
    parser.set_defaults(sessions=16)  # past the grown pool too: 1 offload, then ~20 evictions both ranks agree on
    parser.add_argument("--expand-groups", type=int, default=1,
                        help="expert groups per offload step: 1 makes several agreement rounds")
    args = parser.parse_args(argv)
    if args.model == TINY_MODEL:
        ensure_tiny_model(args.model)
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = demo_spec(args)
    flags = ("--vamp-max-offload-ratio", str(args.ratio), "--vamp-expand-groups", str(args.expand_groups))
    logs = {name: out_dir / f"decisions-{name}.jsonl" for name in ("tp1", "tp2", "nodes2")}
    for path in logs.values():
        for stale in (path, Path(f"{path}.rank1")):
            stale.unlink(missing_ok=True)
    log_dir = str(out_dir / "logs")
    setups = {tp: ServerSetup(args.model, "cpu", args.max_total_tokens, tp_size=tp, log_dir=log_dir) for tp in (1, 2)}
    results = {}
    for name, tp in (("tp1", 1), ("tp2", 2)):
        print(f"--- single node, TP {tp}", flush=True)
        results[name] = _run(setups[tp], ServerConfig(f"vamp-{name}", (*flags, "--vamp-decision-log",
                                                                        str(logs[name]))), spec)
    print("--- two nodes on loopback, TP 2 (one rank per node)", flush=True)
    with tempfile.TemporaryDirectory(prefix="vamp-demo-key-") as key_dir:
        key_file = os.path.join(key_dir, "controller.key")
        generate_key_file(key_file)
        results["nodes2"], network = run_two_nodes(
            setups[2], (*flags, "--vamp-decision-log", str(logs["nodes2"])), (key_file, key_file), spec)
    for name, result in results.items():
        (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out_dir / "network.json").write_text(json.dumps(network, indent=1))
    return report(results, {name: _per_rank(path) for name, path in logs.items()}, network, args)


def report(results: dict[str, dict], decisions: dict[str, list[list[dict]]], network: dict,
           args: argparse.Namespace) -> int:
    rank0, rank1 = decisions["nodes2"]
    offloads = sum(d["plan"]["action"] in OFFLOADS for d in rank0)
    pools = [d["outcome"]["pool_tokens"] for d in rank0]
    digests = {name: r["outputs_digest"] for name, r in results.items()}
    checks = {
        "offload decisions happened on the two nodes": offloads > 0,
        "both ranks logged identical decisions and pool sizes": bool(rank0) and _digest(rank0) == _digest(rank1),
        "greedy outputs identical to single-node TP 2": digests["nodes2"] == digests["tp2"],
        "greedy outputs identical to TP 1": digests["nodes2"] == digests["tp1"],
        "every request completed": all(r["failed"] == 0 for r in results.values()),
        "the VAMP controller listens on 127.0.0.1 only": [
            a for bound in network["listening"].values() for a in bound
            if a.endswith(f":{network['ports']['controller']}")] == [f"127.0.0.1:{network['ports']['controller']}"],
    }
    print(f"\n{args.sessions} sessions x {args.turns} turns, pool {args.max_total_tokens} tokens, "
          f"VAMP ratio {args.ratio}\n")
    titles = {"tp1": "TP 1", "tp2": "TP 2", "nodes2": "2 nodes"}
    print(f"{'':28}" + "".join(f"{titles[n]:>18}" for n in results))
    rows = [("decisions (rank 0)", lambda n: str(len(decisions[n][0]))),
            ("offload/combined (rank 0)", lambda n: str(sum(d["plan"]["action"] in OFFLOADS
                                                            for d in decisions[n][0]))),
            ("decisions (rank 1)", lambda n: str(len(decisions[n][1])) if n != "tp1" else "-"),
            ("prefix-cache hit rate", lambda n: f"{results[n]['cache_hit_rate'] * 100:.1f} %"),
            ("requests ok / failed", lambda n: f"{results[n]['completed']} / {results[n]['failed']}"),
            ("outputs digest", lambda n: digests[n])]
    for label, cell in rows:
        print(f"{label:28}" + "".join(f"{cell(n):>18}" for n in results))
    if pools:
        print(f"\ntwo nodes: KV pool after each decision {min(pools)}..{max(pools)} tokens on both ranks "
              f"({len(rank0)} decisions on rank 0, {len(rank1)} on rank 1)")
    ports = network["ports"]
    print(f"ports: dist-init {ports['dist_init']}, VAMP controller {ports['controller']} (node 0, rank 0), "
          f"HTTP {ports['http_node0']} (node 0), dummy health {ports['health_node1']} (node 1)")
    names = {ports["dist_init"]: "SGLang TCPStore", ports["controller"]: "VAMP controller",
             ports["http_node0"]: "HTTP", ports["health_node1"]: "dummy health"}
    for node, bound in network["listening"].items():
        known = [f"{a} ({names[int(a.rsplit(':', 1)[1])]})" for a in bound if int(a.rsplit(":", 1)[1]) in names]
        others = sorted({a.rsplit(":", 1)[0] for a in bound if int(a.rsplit(":", 1)[1]) not in names})
        rest = len(bound) - len(known)
        print(f"  {node} listens on {', '.join(known)}, and {rest} random ports on {', '.join(others)}")
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
