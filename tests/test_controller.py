"""The rank controller with real processes and real ZMQ ipc sockets (TCP: test_controller_tcp.py).

Each rank runs in its own spawned process and follows a script; every process waits on one barrier
before its script starts, so "late" and "silent" mean the same thing on every run. Time-outs are
0.5 s (followers wait 1 s for the leader); the scripted delays keep 0.3 s or more from every
time-out edge. No assertion is about elapsed time.
"""

import json
import logging
import multiprocessing
import os
import shutil
import signal
import time

import msgpack
import pytest
import zmq

from vamp_sglang.controller import ControllerError, RankController, make_private_ipc_dir
from vamp_sglang.controller.ipc import leader_socket_path
from vamp_sglang.controller.messages import Decision, Outcome, Proposal, Vote, decode, encode

TIMEOUT_S = 0.5
JOIN_GUARD_S = 60  # a hang guard, not a timing assertion


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank_main(rank, world_size, ipc_dir, script, barrier, out_path, link):
    """One rank: open the controller at its first step that is not a sleep, then follow the script.

    ("die",) kills the process on the spot, as a lost node would vanish: no close, no goodbye.
    """
    lines = _Lines()
    log = logging.getLogger("vamp_sglang.controller")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    results, controller = [], None
    barrier.wait(timeout=JOIN_GUARD_S)
    for op, *args in script:
        if op == "sleep":
            time.sleep(args[0])
            continue
        controller = controller or RankController(rank, world_size, ipc_dir, TIMEOUT_S, **link)
        if op == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if op == "agree":
            results.append(controller.agree_min(*args))
        elif op == "ok":
            results.append(controller.all_ok(*args))
    if controller is not None:
        controller.close()
    with open(out_path, "w") as out:
        json.dump({"results": results, "logs": lines.lines}, out)


def run_ranks(tmp_path, world_size, scripts, link=None):
    """Run `scripts` (rank -> steps) in spawned processes; ranks without a script never start.

    `link` holds RankController's TCP arguments (tcp_endpoint, key_file); None means a fresh ipc dir.
    Ranks whose script dies return no result.
    """
    ipc_dir = make_private_ipc_dir() if link is None else None
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(scripts))
    processes = {rank: context.Process(target=_rank_main, args=(rank, world_size, ipc_dir, script, barrier,
                                                               str(tmp_path / f"rank{rank}.json"), link or {}))
                 for rank, script in scripts.items()}
    dying = {rank for rank, script in scripts.items() if ("die",) in script}
    try:
        for process in processes.values():
            process.start()
        for process in processes.values():
            process.join(JOIN_GUARD_S)
        assert {r: p.exitcode for r, p in processes.items()} == {
            r: -signal.SIGKILL if r in dying else 0 for r in processes}
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir)
    return {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in scripts if rank not in dying}


def _agree_then_ok(rounds):
    """The call sequence of the scheduler funnel: agree_min, then all_ok, for each (round, tokens, ok)
    or (round, tokens, ok, purpose)."""
    return [step for r, tokens, ok, *purpose in rounds for step in (("agree", r, tokens, *purpose), ("ok", r, ok))]


def _logged(out, text):
    return [line for line in out["logs"] if text in line]


# --- agreement --------------------------------------------------------------------------------
def test_four_ranks_agree_on_the_minimum_round_after_round_with_the_leader_starting_last(tmp_path):
    tokens_by_round = {1: [100, 40, 70, 90], 2: [5, 50, 60, 70], 3: [30, 30, 0, 30], 4: [800, 900, 1000, 700]}
    scripts = {rank: _agree_then_ok([(r, tokens[rank], True) for r, tokens in tokens_by_round.items()])
               for rank in range(4)}
    scripts[0] = [("sleep", 0.3)] + scripts[0]  # followers connect and propose before the leader binds
    outs = run_ranks(tmp_path, 4, scripts)
    for rank in range(4):
        assert outs[rank]["results"] == [40, True, 5, True, 0, True, 700, True], rank
        assert outs[rank]["logs"] == []


def test_one_failed_remap_rolls_back_every_rank_and_the_next_round_commits(tmp_path):
    scripts = {rank: _agree_then_ok([(1, 64, rank != 2), (2, 32, True)]) for rank in range(3)}
    outs = run_ranks(tmp_path, 3, scripts)
    for rank in range(3):
        assert outs[rank]["results"] == [64, False, 32, True]
    assert _logged(outs[0], "rank 2 voted no on round 1; every rank rolls back")


# --- a round held for another purpose -------------------------------------------------------------
def test_a_rank_holding_another_purpose_fails_the_round_on_every_rank_at_once_and_the_next_agrees(tmp_path):
    # Rank 1's control flow strayed: under round 1 it checks a fingerprint while ranks 0 and 2 agree on
    # a view. The leader starts late: every proposal is queued before it enters round 1.
    scripts = {rank: _agree_then_ok([(1, tokens, True, "agree/view"), (2, tokens, True, "agree/idle")])
               for rank, tokens in ((0, 100), (2, 70))}
    scripts[0] = [("sleep", 0.3)] + scripts[0]
    scripts[1] = _agree_then_ok([(1, 40, True, "equal/view"), (2, 40, True, "agree/idle")])
    outs = run_ranks(tmp_path, 3, scripts)
    for rank in range(3):
        assert outs[rank]["results"] == [0, False, 40, True], rank
        assert not _logged(outs[rank], "within"), rank  # nobody waited out a time-out
    for rank in (0, 2):
        assert _logged(outs[rank], "rank 1 held another round than round 1 ('agree/view'); no remap on any rank")
        assert _logged(outs[rank], "rank 1 held another round than round 1 ('agree/view'); every rank rolls back")
    assert _logged(outs[1], "rank 0 (leader) held round 1 for 'agree/view', not 'equal/view'; rank 1 takes 0")
    assert _logged(outs[1], "rank 0 (leader) held round 1 for 'agree/view', not 'equal/view'; rank 1 rolls back")


def test_a_proposal_kept_for_a_later_round_is_checked_for_its_purpose_when_that_round_starts(caplog):
    ipc_dir = make_private_ipc_dir()
    context = zmq.Context()
    follower = _raw_socket(context, zmq.DEALER, ROUTING_ID=b"rank1")
    try:
        with RankController(0, 2, ipc_dir, TIMEOUT_S) as leader, caplog.at_level(logging.WARNING):
            follower.connect("ipc://" + leader_socket_path(ipc_dir, 0))
            follower.send(encode(Proposal(1, 1, 30, "agree/view")))
            follower.send(encode(Proposal(2, 1, 20, "equal/view")))  # read in round 1, kept for round 2
            assert leader.agree_min(1, 100, "agree/view") == 30
            follower.send(encode(Vote(1, 1, True, "agree/view")))
            assert leader.all_ok(1, True) is True
            assert leader.agree_min(2, 100, "agree/idle") == 0
            assert [decode(follower.recv()) for _ in range(3)][2] == Decision(2, 0, (), (1,), "agree/idle")
            assert "rank 1 held another round than round 2 ('agree/idle'); no remap on any rank" in caplog.text
            assert "did not answer" not in caplog.text  # it did not wait out the time-out
    finally:
        context.destroy(linger=0)
        shutil.rmtree(ipc_dir)


# --- time-outs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("silent_script", [[("sleep", 4 * TIMEOUT_S)], None],
                         ids=["connected-but-silent", "never-started"])
def test_a_rank_that_never_answers_means_no_remap_on_any_rank(tmp_path, silent_script):
    scripts = {0: _agree_then_ok([(1, 100, True)]), 1: _agree_then_ok([(1, 40, True)])}
    if silent_script is not None:
        scripts[2] = [("open",)] + silent_script
    outs = run_ranks(tmp_path, 3, scripts)
    for rank in (0, 1):
        assert outs[rank]["results"] == [0, False]
        assert _logged(outs[rank], "rank 2 did not answer round 1 within 0.5 s; no remap on any rank")
        assert _logged(outs[rank], "rank 2 did not vote on round 1 within 0.5 s; every rank rolls back round 1")


def test_a_silent_leader_means_no_remap_on_the_followers(tmp_path):
    outs = run_ranks(tmp_path, 3, {1: _agree_then_ok([(1, 40, True)]), 2: _agree_then_ok([(1, 50, True)])})
    for rank in (1, 2):
        assert outs[rank]["results"] == [0, False]
        assert _logged(outs[rank], "rank 0 (leader) did not answer round 1 within 1.0 s")
        assert _logged(outs[rank], "rank 0 (leader) did not send the outcome of round 1 within 1.0 s")


def test_a_late_follower_answer_is_discarded_and_the_next_round_agrees(tmp_path):
    # Rank 1 proposes round 1 (20 tokens) after the leader closed round 1; when the leader reads that
    # stale proposal it is in round 2, where applying it would give min(80, 20) = 20 instead of 30.
    leader = _agree_then_ok([(1, 100, True)]) + [("sleep", 0.8)] + _agree_then_ok([(2, 80, True)])
    follower = [("open",), ("sleep", 3 * TIMEOUT_S)] + _agree_then_ok([(1, 20, True), (2, 30, True)])
    outs = run_ranks(tmp_path, 2, {0: leader, 1: follower})
    assert outs[0]["results"] == [0, False, 30, True]
    assert outs[1]["results"] == [0, False, 30, True]
    assert _logged(outs[0], "rank 1 did not answer round 1 within 0.5 s; no remap on any rank")
    assert _logged(outs[0], "discarded a late Proposal for round 1 from rank 1 (now in agree_min of round 2)")
    assert _logged(outs[1], "rank 1 did not answer round 1 within 0.5 s; no remap on any rank")


def test_a_follower_that_gave_up_on_a_late_leader_vetoes_the_round(tmp_path):
    # The leader decides 50 after rank 1 has already taken 0: rank 1's all_ok vote rolls the leader back.
    leader = [("open",), ("sleep", 3 * TIMEOUT_S)] + _agree_then_ok([(1, 100, True)])
    outs = run_ranks(tmp_path, 2, {0: leader, 1: _agree_then_ok([(1, 50, True)])})
    assert outs[0]["results"] == [50, False]
    assert outs[1]["results"] == [0, False]
    assert _logged(outs[1], "rank 0 (leader) did not answer round 1 within 1.0 s; rank 1 takes 0 and vetoes")
    assert _logged(outs[1], "discarded a late Decision for round 1 from rank 0 (now in all_ok of round 1)")
    assert _logged(outs[0], "rank 1 voted no on round 1; every rank rolls back")


# --- malformed messages from a raw socket ------------------------------------------------------
def _raw_socket(context, kind, **options):
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    return sock


GARBAGE_TO_LEADER = [
    [b"\xc1"],
    [msgpack.packb({"type": "Launch", "round_id": 1})],
    [msgpack.packb({"type": "Proposal", "round_id": 1, "rank": 1, "tokens": "5", "purpose": ""})],
    [msgpack.packb({"type": "Proposal", "round_id": 1, "rank": 1, "purpose": ""})],
    [msgpack.packb({"type": "Proposal", "round_id": 1, "rank": 1, "tokens": 5, "purpose": "Agree"})],
    [encode(Proposal(1, 2, 5))],  # claims another rank
    [encode(Decision(1, 5))],  # a leader's message
    [encode(Proposal(1, 1, 5)), b"extra frame"],
]


def test_the_leader_rejects_malformed_messages_as_no_answer(tmp_path, caplog):
    ipc_dir = make_private_ipc_dir()
    context = zmq.Context()
    impostor = _raw_socket(context, zmq.DEALER)  # no routing id: not a follower of this group
    follower = _raw_socket(context, zmq.DEALER, ROUTING_ID=b"rank1")
    try:
        with RankController(0, 2, ipc_dir, TIMEOUT_S) as leader, caplog.at_level(logging.INFO):
            endpoint = "ipc://" + leader_socket_path(ipc_dir, 0)
            impostor.connect(endpoint)
            follower.connect(endpoint)
            impostor.send(encode(Proposal(1, 1, 5)))
            for frames in GARBAGE_TO_LEADER:
                follower.send_multipart(frames)
            assert leader.agree_min(1, 100) == 0
            rejected = [r.getMessage() for r in caplog.records if "rejected a malformed" in r.getMessage()]
            assert len(rejected) == len(GARBAGE_TO_LEADER) + 1
            assert any("unknown peer" in line for line in rejected)
            assert any("Proposal.tokens must be an int (got str)" in line for line in rejected)
            assert any("Proposal.purpose must match" in line for line in rejected)
            assert any("Proposal.rank is 2 but it came from rank 1" in line for line in rejected)
            assert "rank 1 did not answer round 1 within 0.5 s; no remap on any rank" in caplog.text
            assert decode(follower.recv()) == Decision(1, 0, (1,))
            # The channel still works: a well-formed proposal for the next round is agreed on.
            follower.send(encode(Proposal(2, 1, 30)))
            assert leader.agree_min(2, 100) == 30
            assert decode(follower.recv()) == Decision(2, 30, ())
    finally:
        context.destroy(linger=0)
        shutil.rmtree(ipc_dir)


def test_a_follower_rejects_malformed_decisions_and_vetoes_the_round(caplog):
    ipc_dir = make_private_ipc_dir()
    context = zmq.Context()
    fake_leader = _raw_socket(context, zmq.ROUTER, ROUTER_MANDATORY=1)
    fake_leader.bind("ipc://" + leader_socket_path(ipc_dir, 0))
    decision = {"type": "Decision", "round_id": 1, "missing": (), "mismatched": (), "purpose": ""}
    garbage = [b"\xc1", msgpack.packb({**decision, "tokens": -7}), msgpack.packb({**decision, "tokens": True}),
               encode(Proposal(1, 0, 5)), encode(Decision(1, 999))]  # 999 > what rank 1 can add
    try:
        with RankController(1, 2, ipc_dir, TIMEOUT_S) as follower, caplog.at_level(logging.INFO):
            for payload in garbage:
                while True:  # the router can address rank 1 once the connection is up
                    try:
                        fake_leader.send_multipart([b"rank1", payload])
                        break
                    except zmq.ZMQError:
                        time.sleep(0.01)
            assert follower.agree_min(1, 40) == 0
            assert decode(fake_leader.recv_multipart()[1]) == Proposal(1, 1, 40)
            assert caplog.text.count("rank 1 rejected a malformed message from rank 0 (leader)") == 4
            assert "a Proposal is never sent to rank 1" in caplog.text
            assert "rank 0 (leader) decided 999 tokens in round 1, more than rank 1 can add" in caplog.text
            fake_leader.send_multipart([b"rank1", encode(Outcome(1, False))])
            assert follower.all_ok(1, True) is False
            assert decode(fake_leader.recv_multipart()[1]) == Vote(1, 1, False)  # its remap "succeeded", yet no
    finally:
        context.destroy(linger=0)
        shutil.rmtree(ipc_dir)


# --- set-up -------------------------------------------------------------------------------------
def test_the_ipc_dir_must_be_private(tmp_path):
    private = make_private_ipc_dir()
    try:
        assert os.stat(private).st_mode & 0o777 == 0o700
        os.chmod(private, 0o755)
        with pytest.raises(ControllerError, match="has mode 0755; it must be private"):
            RankController(1, 2, private)
        os.chmod(private, 0o700)
        os.symlink(private, tmp_path / "link")
        with pytest.raises(ControllerError, match="must be a directory, not a symlink"):
            RankController(0, 2, str(tmp_path / "link"))
        with pytest.raises(ControllerError, match="does not exist"):
            RankController(0, 2, str(tmp_path / "absent"))
        with pytest.raises(ControllerError, match="too long for a unix socket path"):
            long_dir = tmp_path / ("d" * 100)
            long_dir.mkdir(mode=0o700)
            RankController(0, 2, str(long_dir))
        if os.getuid() == 0:
            os.chown(private, 4242, -1)
            with pytest.raises(ControllerError, match="owned by uid 4242, not by us"):
                RankController(0, 2, private)
            os.chown(private, 0, -1)
    finally:
        shutil.rmtree(private)


def test_one_leader_per_group_and_the_dir_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("VAMP_SGLANG_CONTROL_DIR", raising=False)
    with pytest.raises(ControllerError, match="VAMP_SGLANG_CONTROL_DIR"):
        RankController.from_env(0, 2)
    private = make_private_ipc_dir()
    monkeypatch.setenv("VAMP_SGLANG_CONTROL_DIR", private)
    try:
        with RankController.from_env(0, 2, group_id=0):
            assert os.listdir(private) == ["vamp-ctl-0.sock"]
            with pytest.raises(ControllerError, match="another leader is bound there"):
                RankController.from_env(0, 2, group_id=0)
            with RankController.from_env(0, 2, group_id=1):
                assert sorted(os.listdir(private)) == ["vamp-ctl-0.sock", "vamp-ctl-1.sock"]
    finally:
        shutil.rmtree(private)


def test_a_single_rank_opens_no_socket_and_agrees_with_itself():
    private = make_private_ipc_dir()
    try:
        with RankController(0, 1, private) as alone:
            assert alone.agree_min(1, 123) == 123
            assert alone.all_ok(1, False) is False
            assert alone.agree_min(2, 7) == 7
            assert alone.all_ok(2, True) is True
            assert os.listdir(private) == []
    finally:
        shutil.rmtree(private)


def test_bad_arguments_are_named():
    with RankController(0, 1, None) as alone:
        alone.agree_min(5, 1)
        with pytest.raises(ValueError, match="round_id 5 does not move forward"):
            alone.agree_min(5, 1)
        with pytest.raises(ValueError, match="round_id 4 does not move forward"):
            alone.all_ok(4, True)
        with pytest.raises(ValueError, match=r"tokens must be >= 0 \(got -1\)"):
            alone.agree_min(6, -1)
        with pytest.raises(TypeError, match="tokens must be an int"):
            alone.agree_min(6, 1.5)
        with pytest.raises(TypeError, match="ok must be a bool"):
            alone.all_ok(6, 1)
        with pytest.raises(ValueError, match="purpose must be a short call-site name"):
            alone.agree_min(6, 1, "Agree View")
    with pytest.raises(ValueError, match="rank must be in"):
        RankController(2, 2, None)
    with pytest.raises(ValueError, match="timeout_s must be a positive finite number"):
        RankController(0, 1, None, timeout_s=0)
