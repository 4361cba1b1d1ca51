"""The controller across nodes: ZMQ over TCP, authenticated and encrypted with CURVE.

With `--nnodes > 1` the TP ranks of one group live on several machines, so the private ipc
directory cannot hold their sockets. Rank 0 (always on node 0) binds one TCP port on the interface
of `--dist-init-addr`'s host, never on all interfaces, and every other rank connects to it. Every
node derives the same endpoint from its own `--dist-init-addr` (SGLang requires the same value on
all nodes): port `--vamp-controller-port`, or the dist-init port + 7, just past the block D..D+6
that SGLang's own port layout may use.

Only holders of the deployment's key file (see `keys`) get through. The pitfalls this guards
against, each covered by a test:
- pyzmq accepts any CURVE client key when no ZAP handler answers; `ZAP_ENFORCE_DOMAIN` makes the
  leader fail closed instead, so a stopped authenticator rejects everyone.
- Rejected peers see no error and libzmq retries every 100 ms, so rejections are logged from the
  socket monitor, rate-limited, and a rejected peer is never answered (no message gets through).
- Each controller has its own zmq.Context: a second authenticator on a shared context fails.
CURVE protects only this channel; SGLang's own TCPStore, gloo and broadcast traffic stay plain.
"""

import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from vamp_sglang.controller.ipc import ControllerError
from vamp_sglang.controller.keys import DeploymentKey
from vamp_sglang.controller.messages import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

PORT_OFFSET = 7  # default controller port = dist-init port + 7 (SGLang may use D+1..D+6)
ZAP_DOMAIN = b"vamp-controller"
REJECTION_LOG_INTERVAL_S = 10.0  # a rejected peer retries every 100 ms; one log line per reason per 10 s
_FAILED_HANDSHAKE = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(frozen=True)
class TcpEndpoint:
    """The leader's address: a numeric IP of one interface (never a wildcard) and a port."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if ipaddress.ip_address(self.host).is_unspecified:
            raise ControllerError(f"the controller must not bind every interface ({self.host})")
        if not 0 < self.port < 65536:
            raise ControllerError(f"controller port {self.port} is not in [1, 65535]")

    @property
    def is_ipv6(self) -> bool:
        return ipaddress.ip_address(self.host).version == 6

    @property
    def url(self) -> str:
        return f"tcp://[{self.host}]:{self.port}" if self.is_ipv6 else f"tcp://{self.host}:{self.port}"

    def for_group(self, group_id: int) -> "TcpEndpoint":
        """One leader port per TP group, as with ipc: group g uses port + g."""
        return TcpEndpoint(self.host, self.port + group_id)


def split_host_port(addr: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`, as SGLang's --dist-init-addr takes them."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ControllerError(f"--dist-init-addr {addr!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def leader_endpoint(dist_init_addr: str, controller_port: int = 0) -> TcpEndpoint:
    """Where rank 0 binds and the others connect; `controller_port` 0 means dist-init port + 7."""
    host, dist_port = split_host_port(dist_init_addr)
    if host in ("*", "") or (_is_ip(host) and ipaddress.ip_address(host).is_unspecified):
        raise ControllerError(f"--dist-init-addr host {host!r} is a wildcard; give the address of node 0's "
                              "interface (the controller never binds every interface)")
    try:
        resolved = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise ControllerError(f"--dist-init-addr host {host!r} does not resolve ({exc})") from None
    port = controller_port or dist_port + PORT_OFFSET
    if port > 65535:
        raise ControllerError(f"the controller port (--dist-init-addr port {dist_port} + {PORT_OFFSET}) exceeds "
                              "65535; give --vamp-controller-port")
    return TcpEndpoint(resolved, port)


def check_port_free(endpoint: TcpEndpoint) -> None:
    """Node 0's launcher fails fast if the port is taken or the host is not one of its interfaces."""
    family = socket.AF_INET6 if endpoint.is_ipv6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((endpoint.host, endpoint.port))
        except OSError as exc:
            raise ControllerError(f"node 0 cannot bind the controller port {endpoint.url} ({exc.strerror}); "
                                  "free it or give --vamp-controller-port") from None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _common_options(sock: zmq.Socket, endpoint: TcpEndpoint) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # the default (-1) makes ctx.term() hang on a lost peer
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)  # drop the connection of a peer sending floods
    if endpoint.is_ipv6:
        sock.setsockopt(zmq.IPV6, 1)


def bind_leader_socket(context: zmq.Context, endpoint: TcpEndpoint, key: DeploymentKey) -> zmq.Socket:
    """Rank 0's CURVE-server ROUTER. Fails closed: without a ZAP handler on `context` nobody gets in."""
    sock = context.socket(zmq.ROUTER)
    try:
        _common_options(sock, endpoint)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # report a send to a vanished rank
        sock.curve_secretkey, sock.curve_publickey = key.secret, key.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: reject, do not accept any key
        sock.bind(endpoint.url)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def follower_socket(context: zmq.Context, endpoint: TcpEndpoint, key: DeploymentKey, routing_id: bytes) -> zmq.Socket:
    """A follower's CURVE-client DEALER, not yet connected; it queues until the leader binds and admits it."""
    sock = context.socket(zmq.DEALER)
    _common_options(sock, endpoint)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.curve_secretkey, sock.curve_publickey = key.secret, key.public
    sock.curve_serverkey = key.public
    return sock


class _DeploymentKeyOnly:
    """The ZAP callback: admit a CURVE client only if its public key is the deployment's."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return hmac.compare_digest(client_key, self._public)


def _rejection_reason(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"its CURVE key is not this deployment's (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "it does not speak CURVE (no key)"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "it does not hold this deployment's key (CURVE handshake did not decrypt)"
        return f"protocol error {zmq.Event(value).name}"
    return (f"the handshake failed without detail ({os.strerror(value)}: no authenticator answered, or the peer "
            "hung up, as one without CURVE may)")


def _refusal_reason(event: int, value: int) -> str:
    """A follower's view: the leader refused its key, or broke the handshake off (it holds another key)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the leader refused this rank's key (ZAP status {value})"
    detail = zmq.Event(value).name if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL else os.strerror(value)
    return f"the leader broke the CURVE handshake off ({detail}): it holds another key"


class _HandshakeLog(threading.Thread):
    """Logs every failed handshake on a socket, at most one line per reason per interval: `line` takes
    the count, a plural "s" and the reason that `reason(event, value)` gives."""

    def __init__(self, sock: zmq.Socket, line: str, reason: Callable[[int, int], str]) -> None:
        super().__init__(name="vamp-controller-handshakes", daemon=True)
        self._monitor = sock.get_monitor_socket(_FAILED_HANDSHAKE)
        self._line, self._reason = line, reason
        self._stopping = threading.Event()
        self._last_logged_s: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._monitor.poll(100, zmq.POLLIN):
                    event = recv_monitor_message(self._monitor)
                    self._note(self._reason(event["event"], event["value"]))
            self._flush()
        finally:
            self._monitor.close(linger=0)

    def stop(self) -> None:
        self._stopping.set()
        self.join()

    def _note(self, reason: str) -> None:
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._last_logged_s.get(reason, -REJECTION_LOG_INTERVAL_S) >= REJECTION_LOG_INTERVAL_S:
            self._last_logged_s[reason] = now
            self._log(reason)

    def _flush(self) -> None:
        for reason in list(self._unlogged):
            self._log(reason)

    def _log(self, reason: str) -> None:
        count = self._unlogged.pop(reason, 0)
        if count:
            logger.warning(self._line, count, "" if count == 1 else "s", reason)


class TcpChannel:
    """One rank's TCP socket, the log of its failed handshakes and, on the leader, the authenticator."""

    def __init__(self, context: zmq.Context, endpoint: TcpEndpoint, key: DeploymentKey, is_leader: bool,
                 routing_id: bytes, who: str) -> None:
        self.endpoint = endpoint
        self._authenticator: ThreadAuthenticator | None = None
        if not is_leader:
            self.socket = follower_socket(context, endpoint, key, routing_id)
            self._handshakes = _HandshakeLog(
                self.socket, f"vamp controller: {who} failed %d handshake%s with the leader at "
                f"{endpoint.url}: %s; is --vamp-controller-key-file the same file on every node?", _refusal_reason)
            self._handshakes.start()
            self.socket.connect(endpoint.url)
            return
        self._authenticator = ThreadAuthenticator(context, log=logger.getChild("zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(ZAP_DOMAIN.decode(), _DeploymentKeyOnly(key.public))
        try:
            self.socket = bind_leader_socket(context, endpoint, key)
        except zmq.ZMQError as exc:
            self._authenticator.stop()
            raise ControllerError(f"rank 0 cannot bind the controller port {endpoint.url}: {exc}") from exc
        self._handshakes = _HandshakeLog(
            self.socket, f"vamp controller: rank 0 rejected %d connection attempt%s on {endpoint.url}: %s; never "
            "answered", _rejection_reason)
        self._handshakes.start()

    def close(self) -> None:
        self.socket.disable_monitor()
        self._handshakes.stop()
        self.socket.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
