"""eval.servers: a server whose HTTP port was taken before it bound it is restarted on another port.

SGLang's own processes pick free ports for their ZMQ sockets; one landed on the port our harness had picked
for HTTP (seen in `make test`), uvicorn logged "address already in use" and the server hung until the 300 s
start-up timeout. The real launcher takes 25 s to start, so a stand-in process plays the server here: it logs
what uvicorn logs on that port and then stays up without serving, as the real one did.
"""

import sys
import time

import pytest

from eval import servers
from eval.servers import PortTaken, Server, ServerConfig, ServerSetup

HANGS_AFTER_BIND_ERROR = (  # the message is joined at run time: the log's first line is this command itself
    "import sys, time; words = 'error_while_attempting_to_bind_on_address'.split('_'); "
    "print('ERROR:    [Errno 98]', ' '.join(words), f\"('127.0.0.1', {sys.argv[1]}): address already in use\", "
    "flush=True); time.sleep(60)"
)


@pytest.fixture
def stand_in(monkeypatch):
    """Servers launched as the stand-in; the ports each launch was given."""
    ports = []

    def argv(setup, config, port):
        ports.append(port)
        return [sys.executable, "-c", HANGS_AFTER_BIND_ERROR, str(port)]

    monkeypatch.setattr(servers, "launch_argv", argv)
    monkeypatch.setattr(servers, "LOCK_PATH", None)
    return ports


def test_a_taken_port_is_named_at_once_and_retried_on_fresh_ports(stand_in, tmp_path):
    server = Server(ServerSetup("unused", log_dir=str(tmp_path), startup_timeout_s=60), ServerConfig("x", ()))
    start = time.monotonic()
    with pytest.raises(PortTaken) as taken:
        server.start()
    assert f"port {stand_in[-1]} taken" in str(taken.value)
    assert time.monotonic() - start < 30  # each attempt noticed within seconds, not after the 60 s time-out
    assert len(stand_in) == servers.PORT_ATTEMPTS and len(set(stand_in)) == servers.PORT_ATTEMPTS
    assert server.process.poll() is not None  # every stand-in was stopped
