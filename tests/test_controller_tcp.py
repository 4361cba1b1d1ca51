"""The rank controller across nodes: real processes, real TCP sockets on loopback, real CURVE keys.

Covers what `--nnodes > 1` relies on: the ranks agree over TCP, a lost node means no remap on any
rank while the others keep agreeing, a peer without the deployment's key (wrong key, no key, or
not even the server's public key) is rejected, logged and never answered, a leader without a ZAP
handler fails closed (pyzmq would accept any key), and replayed or out-of-round messages are
discarded. Time-outs are those of test_controller.py; no assertion is about elapsed time.
"""

import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
import zmq
from test_controller import TIMEOUT_S, _agree_then_ok, _logged, run_ranks

from vamp_sglang import config
from vamp_sglang.controller import ControllerError, RankController
from vamp_sglang.controller.keys import generate_key_file, load_key_file
from vamp_sglang.controller.messages import Decision, Proposal, decode, encode
from vamp_sglang.controller.tcp import TcpEndpoint, bind_leader_socket, check_port_free, leader_endpoint

NEVER_ANSWERED_WAIT_MS = 1000


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def deployment(tmp_path):
    """A key file made by keygen and a free loopback endpoint: what two launchers would share."""
    key_file = str(tmp_path / "vamp.key")
    generate_key_file(key_file)
    return {"tcp_endpoint": TcpEndpoint("127.0.0.1", _free_port()), "key_file": key_file}


def _peer(context, endpoint, public=None, secret=None, server_key=None, routing_id=b"rank1"):
    """A raw DEALER playing rank 1; with `public` None it speaks no CURVE at all."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if public is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_key
    sock.connect(endpoint.url)
    return sock


def _wait_for(predicate, guard_s=10.0):
    """Poll `predicate` until true; the guard only stops a hang, it is no timing assertion."""
    deadline = time.monotonic() + guard_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


# --- agreement over TCP --------------------------------------------------------------------------
def test_three_ranks_agree_over_tcp_with_the_leader_starting_last(tmp_path, deployment):
    tokens_by_round = {1: [100, 40, 70], 2: [5, 50, 60], 3: [30, 30, 0]}
    scripts = {rank: _agree_then_ok([(r, tokens[rank], rank != 1 or r != 2) for r, tokens in tokens_by_round.items()])
               for rank in range(3)}
    scripts[0] = [("sleep", 0.3)] + scripts[0]  # followers connect and propose before the leader binds
    outs = run_ranks(tmp_path, 3, scripts, deployment)
    for rank in range(3):
        assert outs[rank]["results"] == [40, True, 5, False, 0, True], rank
    assert _logged(outs[0], "rank 1 voted no on round 2; every rank rolls back")


def test_a_lost_node_means_no_remap_on_any_rank_and_the_others_keep_agreeing(tmp_path, deployment):
    # Rank 2 (node 1) vanishes after round 1: rounds 2 and 3 agree 0 and roll back on ranks 0 and 1.
    rounds = [(1, 64, True), (2, 32, True), (3, 16, True)]
    scripts = {0: _agree_then_ok(rounds), 1: _agree_then_ok(rounds), 2: _agree_then_ok(rounds[:1]) + [("die",)]}
    outs = run_ranks(tmp_path, 3, scripts, deployment)
    for rank in (0, 1):
        assert outs[rank]["results"] == [64, True, 0, False, 0, False], rank
        for r in (2, 3):
            assert _logged(outs[rank], f"rank 2 did not answer round {r} within 0.5 s; no remap on any rank")


def test_a_lost_leader_means_no_remap_on_the_followers(tmp_path, deployment):
    rounds = [(1, 64, True), (2, 32, True)]
    # The leader lets its round-1 Outcome leave before it vanishes (an Outcome lost in flight is the gap
    # agreement.py documents), then dies before round 2.
    leader = _agree_then_ok(rounds[:1]) + [("sleep", 0.3), ("die",)]
    outs = run_ranks(tmp_path, 2, {0: leader, 1: _agree_then_ok(rounds)},
                     deployment)
    assert outs[1]["results"] == [64, True, 0, False]
    assert _logged(outs[1], "rank 0 (leader) did not answer round 2 within 1.0 s")


def test_from_env_chooses_tcp_when_the_launcher_exported_an_endpoint(monkeypatch, deployment):
    endpoint = deployment["tcp_endpoint"]
    monkeypatch.delenv(config.ENV_CONTROL_DIR, raising=False)
    monkeypatch.setenv(config.ENV_CONTROLLER_TCP,
                       config.controller_tcp_env(endpoint.host, endpoint.port, deployment["key_file"])
                       [config.ENV_CONTROLLER_TCP])
    follower_result = []
    with RankController.from_env(0, 2, TIMEOUT_S) as leader:
        with pytest.raises(ConnectionRefusedError):  # bound to 127.0.0.1 only, not every interface
            socket.create_connection(("127.0.0.2", endpoint.port), timeout=5).close()

        def follow():
            with RankController.from_env(1, 2, TIMEOUT_S) as follower:
                follower_result.append(follower.agree_min(1, 30))
                follower_result.append(follower.all_ok(1, True))

        thread = threading.Thread(target=follow)
        thread.start()
        assert leader.agree_min(1, 50) == 30
        assert leader.all_ok(1, True) is True
        thread.join(30)
    assert follower_result == [30, True]


# --- peers without the key --------------------------------------------------------------------------
IMPOSTORS = {
    "wrong-key": (("its CURVE key is not this deployment's",), True),  # knows the server's public key
    "wrong-server-key": (("does not hold this deployment's key",), False),
    # libzmq sees either the mechanism mismatch or the peer hanging up first, depending on the race
    "no-key": (("does not speak CURVE (no key)", "the handshake failed without detail"),
               None),
}


@pytest.mark.parametrize("kind", IMPOSTORS)
def test_a_peer_without_the_key_is_rejected_logged_and_never_answered(deployment, caplog, kind):
    expected_log, knows_server_key = IMPOSTORS[kind]
    endpoint, key = deployment["tcp_endpoint"], load_key_file(deployment["key_file"])
    context = zmq.Context()
    try:
        with caplog.at_level(logging.INFO), RankController(0, 2, None, TIMEOUT_S, **deployment) as leader:
            if knows_server_key is None:
                impostor = _peer(context, endpoint)
            else:
                public, secret = zmq.curve_keypair()
                impostor = _peer(context, endpoint, public, secret, key.public if knows_server_key else public)
            impostor.send(encode(Proposal(1, 1, 5)))
            assert leader.agree_min(1, 100) == 0  # the impostor's proposal never reached the leader
            assert leader.all_ok(1, True) is False
            assert impostor.poll(NEVER_ANSWERED_WAIT_MS) == 0  # no Decision, no Outcome
            assert _wait_for(lambda: any(line in caplog.text for line in expected_log)), caplog.text
            assert "rank 0 rejected" in caplog.text and "never answered" in caplog.text
            assert "rank 1 did not answer round 1 within 0.5 s; no remap on any rank" in caplog.text
            # The same leader admits the holder of the key file.
            holder = _peer(context, endpoint, key.public, key.secret, key.public)
            holder.send(encode(Proposal(2, 1, 30)))
            assert leader.agree_min(2, 100) == 30
            assert decode(holder.recv()) == Decision(2, 30, ())
    finally:
        context.destroy(linger=0)


def test_a_rank_holding_another_key_file_says_so_and_no_rank_remaps(tmp_path, deployment, caplog):
    other = str(tmp_path / "other.key")
    generate_key_file(other)
    follower_result = []

    def follow():
        with RankController(1, 2, None, TIMEOUT_S, tcp_endpoint=deployment["tcp_endpoint"], key_file=other) as follower:
            follower_result.extend([follower.agree_min(1, 30), follower.all_ok(1, True)])

    with caplog.at_level(logging.INFO), RankController(0, 2, None, TIMEOUT_S, **deployment) as leader:
        thread = threading.Thread(target=follow)
        thread.start()
        assert [leader.agree_min(1, 50), leader.all_ok(1, True)] == [0, False]
        thread.join(30)
    assert follower_result == [0, False]
    assert "rank 0 rejected" in caplog.text and "does not hold this deployment's key" in caplog.text
    assert "rank 1 failed" in caplog.text and "handshake" in caplog.text
    assert "is --vamp-controller-key-file the same file on every node?" in caplog.text


def _delivered(server, client) -> bool:
    client.send(encode(Proposal(1, 1, 5)))
    return server.poll(NEVER_ANSWERED_WAIT_MS) != 0


def test_without_a_zap_handler_the_leader_fails_closed_where_pyzmq_accepts_any_key(deployment):
    endpoint, key = deployment["tcp_endpoint"], load_key_file(deployment["key_file"])
    context = zmq.Context()  # no authenticator runs on this context
    try:
        leader = bind_leader_socket(context, endpoint, key)
        stranger_public, stranger_secret = zmq.curve_keypair()
        assert not _delivered(leader, _peer(context, endpoint, stranger_public, stranger_secret, key.public))
        assert not _delivered(leader, _peer(context, endpoint, key.public, key.secret, key.public,
                                            routing_id=b"rank2"))
        # The pitfall itself: the same CURVE server without ZAP_ENFORCE_DOMAIN takes the stranger.
        open_door = context.socket(zmq.ROUTER)
        open_door.setsockopt(zmq.LINGER, 0)
        open_door.curve_secretkey, open_door.curve_publickey, open_door.curve_server = key.secret, key.public, True
        open_door.zap_domain = b"vamp-controller"
        other = TcpEndpoint("127.0.0.1", _free_port())
        open_door.bind(other.url)
        assert _delivered(open_door, _peer(context, other, stranger_public, stranger_secret, key.public))
    finally:
        context.destroy(linger=0)


# --- replayed and out-of-round messages from a key holder -------------------------------------------
def test_replayed_and_out_of_round_messages_are_discarded(deployment, caplog):
    endpoint, key = deployment["tcp_endpoint"], load_key_file(deployment["key_file"])
    context = zmq.Context()
    try:
        with caplog.at_level(logging.INFO), RankController(0, 3, None, TIMEOUT_S, **deployment) as leader:
            rank1 = _peer(context, endpoint, key.public, key.secret, key.public)
            rank2 = _peer(context, endpoint, key.public, key.secret, key.public, routing_id=b"rank2")
            rank1.send(encode(Proposal(1, 1, 40)))
            rank1.send(encode(Proposal(1, 1, 40)))  # replayed within the round
            rank2.send(encode(Proposal(1, 1, 1)))  # rank 2 speaking for rank 1
            rank2.send(encode(Proposal(1, 2, 60)))
            assert leader.agree_min(1, 100) == 40
            leader.all_ok(1, False)
            rank1.send(encode(Proposal(1, 1, 10)))  # replay of a closed round: 10 would win round 2
            rank1.send(encode(Proposal(2, 1, 50)))
            rank2.send(encode(Proposal(2, 2, 70)))
            assert leader.agree_min(2, 100) == 50
            # the replay is read either while round 1 is open or after it closed, by socket timing;
            # either way it is logged as not applied (and agree_min(2) == 50 shows it was not)
            assert ("ignored a second Proposal for round 1 from rank 1" in caplog.text
                    or "discarded a late Proposal for round 1 from rank 1" in caplog.text)
            assert "Proposal.rank is 1 but it came from rank 2" in caplog.text
            assert "discarded a late Proposal for round 1 from rank 1 (now in agree_min of round 2)" in caplog.text
    finally:
        context.destroy(linger=0)


# --- keys, endpoints, refusals ------------------------------------------------------------------------
def test_keygen_writes_an_owner_only_pair_once(tmp_path):
    path = tmp_path / "vamp.key"
    done = subprocess.run([sys.executable, "-m", "vamp_sglang.controller", "keygen", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = load_key_file(str(path))
    assert zmq.curve_public(key.secret) == key.public and key.public.decode() in done.stdout
    assert "secret" not in repr(key) and key.secret.decode() not in repr(key)
    again = subprocess.run([sys.executable, "-m", "vamp_sglang.controller", "keygen", str(path)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    assert load_key_file(str(path)) == key


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_key_file_others_can_read_is_refused_before_any_socket_opens(tmp_path, mode):
    path = str(tmp_path / "vamp.key")
    generate_key_file(path)
    os.chmod(path, mode)
    port = _free_port()
    with pytest.raises(ControllerError, match=f"has mode {mode:04o}; it must be private \\(chmod 600"):
        RankController(0, 2, None, TIMEOUT_S, tcp_endpoint=TcpEndpoint("127.0.0.1", port), key_file=path)
    check_port_free(TcpEndpoint("127.0.0.1", port))  # nothing was bound


def test_bad_key_files_are_refused(tmp_path):
    missing = str(tmp_path / "absent.key")
    with pytest.raises(ControllerError, match="does not exist; make one with"):
        load_key_file(missing)
    real = str(tmp_path / "real.key")
    generate_key_file(real)
    os.symlink(real, tmp_path / "link.key")
    with pytest.raises(ControllerError, match="must be a regular file, not a symlink"):
        load_key_file(str(tmp_path / "link.key"))
    public, secret = zmq.curve_keypair()
    other_public, _ = zmq.curve_keypair()
    for name, text, error in [
        ("public-only.key", f'curve\n    public-key = "{public.decode()}"\n', "no valid secret-key"),
        ("garbage.key", "not a certificate\n", "is not a CURVE key pair"),
        ("mismatch.key", f'curve\n    public-key = "{other_public.decode()}"\n    secret-key = "{secret.decode()}"\n',
         "does not belong to the secret-key"),
    ]:
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o600)
        with pytest.raises(ControllerError, match=error):
            load_key_file(str(path))
    with pytest.raises(ControllerError, match="needs a key_file"):
        RankController(0, 2, None, tcp_endpoint=TcpEndpoint("127.0.0.1", _free_port()))


def test_the_endpoint_comes_from_dist_init_addr_and_is_never_a_wildcard():
    assert leader_endpoint("127.0.0.1:25000") == TcpEndpoint("127.0.0.1", 25007)
    assert leader_endpoint("127.0.0.1:25000", 31000) == TcpEndpoint("127.0.0.1", 31000)
    assert leader_endpoint("[::1]:25000").url == "tcp://[::1]:25007"
    assert leader_endpoint("localhost:25000").host in ("127.0.0.1", "::1")
    for wildcard in ("0.0.0.0:25000", "[::]:25000", "*:25000"):
        with pytest.raises(ControllerError, match="is a wildcard"):
            leader_endpoint(wildcard)
    with pytest.raises(ControllerError, match="must not bind every interface"):
        TcpEndpoint("0.0.0.0", 25007)
    with pytest.raises(ControllerError, match="exceeds 65535; give --vamp-controller-port"):
        leader_endpoint("127.0.0.1:65530")
    with pytest.raises(ControllerError, match="is not HOST:PORT"):
        leader_endpoint("127.0.0.1")
    with pytest.raises(ControllerError, match="does not resolve"):
        leader_endpoint("no-such-host.invalid:25000")


def test_a_taken_controller_port_is_refused(deployment):
    endpoint = deployment["tcp_endpoint"]
    with RankController(0, 2, None, TIMEOUT_S, **deployment):
        with pytest.raises(ControllerError, match="cannot bind the controller port"):
            check_port_free(endpoint)
        with pytest.raises(ControllerError, match="rank 0 cannot bind the controller port"):
            RankController(0, 2, None, TIMEOUT_S, **deployment)
    check_port_free(endpoint)  # released on close



def test_the_demo_reads_which_interface_each_listener_is_bound_to(deployment):
    """eval.demo_multinode's /proc reader, which checks the leader's single interface on the real servers."""
    from eval.demo_multinode import listeners

    port = deployment["tcp_endpoint"].port
    with socket.socket(socket.AF_INET6) as wildcard, \
            RankController(0, 2, None, TIMEOUT_S, **deployment):
        wildcard.bind(("::", 0))
        wildcard.listen()
        bound = listeners(os.getpgid(0))
        assert f"127.0.0.1:{port}" in bound
        assert f"[::]:{wildcard.getsockname()[1]}" in bound
