"""TP ranks agree on how many KV tokens to add, so every rank remaps exactly that amount or none.

Every TP rank of an SGLang scheduler reaches the KV shortfall funnel at the same point with the same
arguments, but each rank's memory can differ a little, so the ranks must agree before any of them
moves expert pages. Rank 0 leads: it binds a ZMQ ROUTER socket in a private ipc directory (one
node) or on TCP with CURVE authentication (`--nnodes > 1`, see `tcp`), the followers connect DEALER
sockets named after their rank (either side may start first). A round is

    n = ctl.agree_min(round_id, tokens_i_can_add, purpose)  # phase 0: leader takes the minimum, broadcasts it
    ok = remap(n) if n else True                             # each rank tries exactly n
    if not ctl.all_ok(round_id, ok): roll_back()             # phase 1: commit only if every rank succeeded

Call `all_ok` after every `agree_min` on every rank, also when n is 0, so the call sequence is the
same everywhere whatever happened.

A round is its id and its purpose (the call site holding it, named by the caller). A rank whose
control flow strayed (it skipped a round, or held one the others did not) can hold another call
under the same id: the leader then finds the purposes differ, and that round fails on every rank
that held it (0, then "roll back"), at once and with the same line logged everywhere, so one rank's
remap is never committed by another rank's answer to a different question. Realigning the ids
afterwards is the caller's (see `rounds`: ids restart from the replicated tick).

Time-outs never lead to a partial remap. The leader waits `timeout_s` for the followers; a missing
or malformed answer makes the decision 0 (or the outcome "roll back") for everyone, and every rank
logs the same line naming the silent ranks. A follower waits twice as long for the leader (so a
leader that enters the round up to one time-out later still reaches it); if it still hears nothing
it takes 0 and votes "no" in phase 1 of that round, so ranks that did remap roll back. The one gap
left is the last message: a follower that misses an Outcome for over 2 * timeout_s rolls back while
the others commit; that needs a leader stalled between receiving the votes and sending the outcome.

Round ids must increase from call to call. A message for an older round or phase is discarded and
logged, never applied to a newer one; one for a later round (a rank that skipped ahead) is kept
until that round starts, and its purpose is checked then. Not thread-safe: one controller per
scheduler process.
"""

import logging
import math
import os
import re
import time
from typing import Self

import zmq

from vamp_sglang import config
from vamp_sglang.controller.ipc import ControllerError, check_private_dir, leader_socket_path
from vamp_sglang.controller.keys import load_key_file
from vamp_sglang.controller.messages import (
    PHASE_OF,
    Decision,
    MalformedMessage,
    Message,
    Outcome,
    Proposal,
    Vote,
    decode,
    encode,
    is_purpose,
)
from vamp_sglang.controller.tcp import TcpChannel, TcpEndpoint

logger = logging.getLogger(__name__)

LEADER_RANK = 0
_ROUTING_ID = re.compile(rb"rank([0-9]{1,4})")
Stage = tuple[int, int]  # (round_id, phase); phase 0 = agree_min, 1 = all_ok
Answers = tuple[dict[int, Message], dict[int, str]]  # this round's message by sender; another round's purpose by sender


def _routing_id(rank: int) -> bytes:
    return b"rank%d" % rank


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _check_count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int (got {type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (got {value})")
    return value


class RankController:
    """One TP rank's end of the agreement; `world_size` 1 needs no sockets and agrees with itself.

    The ranks meet in `ipc_dir`, or, when `tcp_endpoint` is given, at that TCP endpoint, admitted by
    the CURVE key pair in `key_file`.
    """

    def __init__(self, rank: int, world_size: int, ipc_dir: str | None, timeout_s: float = 5.0,
                 group_id: int = 0, tcp_endpoint: TcpEndpoint | None = None, key_file: str | None = None) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1 (got {world_size!r})")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) (got {rank!r})")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive finite number (got {timeout_s!r})")
        _check_count("group_id", group_id)
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self._last_stage: Stage = (-1, 1)
        self._purpose = ""  # of the round agree_min entered last; all_ok's messages carry it too
        self._vetoed_round: int | None = None  # a round that timed out: all_ok votes no
        self._stash: dict[tuple[Stage, int], Message] = {}  # messages for a later stage, by sender
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._channel: TcpChannel | None = None
        if world_size == 1:
            return
        if tcp_endpoint is not None:
            if key_file is None:
                raise ControllerError("a TCP controller needs a key_file (--vamp-controller-key-file)")
            self._open_tcp(tcp_endpoint.for_group(group_id), key_file)
            return
        if ipc_dir is None:
            raise ControllerError(f"world_size {world_size} needs an ipc_dir (set {config.ENV_CONTROL_DIR})")
        check_private_dir(ipc_dir)
        self._open(leader_socket_path(ipc_dir, group_id))

    @classmethod
    def from_env(cls, rank: int, world_size: int, timeout_s: float = 5.0, group_id: int = 0) -> "RankController":
        """The controller of a scheduler process: TCP when the VAMP launcher exported an endpoint
        (`--nnodes > 1`), else the ipc_dir it exported."""
        tcp = config.controller_tcp()
        if tcp is not None:
            host, port, key_file = tcp
            return cls(rank, world_size, None, timeout_s, group_id, TcpEndpoint(host, port), key_file)
        return cls(rank, world_size, config.control_dir(), timeout_s, group_id)

    @property
    def is_leader(self) -> bool:
        return self.rank == LEADER_RANK

    def _open(self, path: str) -> None:
        self._context = zmq.Context()
        try:
            if self.is_leader:
                if os.path.exists(path):  # zmq would silently take the path over from the other leader
                    raise ControllerError(f"{path} exists: another leader is bound there; give each TP "
                                          "group its own group_id")
                self._socket = self._context.socket(zmq.ROUTER)
                self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # report a send to a vanished rank
                self._socket.setsockopt(zmq.LINGER, 0)
                self._socket.bind("ipc://" + path)
            else:
                self._socket = self._context.socket(zmq.DEALER)
                self._socket.setsockopt(zmq.ROUTING_ID, _routing_id(self.rank))
                self._socket.setsockopt(zmq.LINGER, 0)
                self._socket.connect("ipc://" + path)  # queues until the leader binds
        except (zmq.ZMQError, ControllerError) as exc:
            self.close()
            raise ControllerError(f"rank {self.rank} cannot open the controller socket {path}: {exc}") from exc

    def _open_tcp(self, endpoint: TcpEndpoint, key_file: str) -> None:
        key = load_key_file(key_file)
        self._context = zmq.Context()  # our own: one ZAP authenticator per context
        try:
            self._channel = TcpChannel(self._context, endpoint, key, self.is_leader, _routing_id(self.rank),
                                       f"rank {self.rank}")
        except (zmq.ZMQError, ControllerError) as exc:
            self.close()
            raise ControllerError(f"rank {self.rank} cannot open the controller on {endpoint.url}: {exc}") from exc
        self._socket = self._channel.socket

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel, self._socket = None, None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the two phases ------------------------------------------------------------------------
    def agree_min(self, round_id: int, tokens: int, purpose: str = "") -> int:
        """The minimum of every rank's `tokens`, the same on every rank; 0 if any rank is silent or
        held another `purpose` under this round id."""
        _check_count("tokens", tokens)
        if not is_purpose(purpose):
            raise ValueError(f"purpose must be a short call-site name [a-z0-9_./-] (got {purpose!r:.40})")
        self._enter((round_id, 0))
        self._purpose = purpose
        if self.world_size == 1:
            return tokens
        if self.is_leader:
            proposals, strays = self._gather((round_id, 0), self._follower_ranks(), self.timeout_s)
            missing, mismatched = self._absent(proposals, strays), tuple(sorted(strays))
            common = 0 if missing or mismatched else min([tokens] + [p.tokens for p in proposals.values()])
            self._broadcast(Decision(round_id, common, missing, mismatched, purpose))
            self._note_failures(round_id, missing, mismatched)
            return common
        self._send_to_leader(Proposal(round_id, self.rank, tokens, purpose))
        decisions, strays = self._gather((round_id, 0), (LEADER_RANK,), 2 * self.timeout_s)
        decision = decisions.get(LEADER_RANK)
        if decision is None or decision.tokens > tokens:
            reason = (self._leader_strayed(round_id, strays) if strays else
                      f"did not answer round {round_id} within {2 * self.timeout_s:.1f} s" if decision is None else
                      f"decided {decision.tokens} tokens in round {round_id}, more than rank {self.rank} can add")
            logger.warning("vamp controller: rank 0 (leader) %s; rank %d takes 0 and vetoes the round, so no rank "
                           "keeps a remap", reason, self.rank)
            self._vetoed_round = round_id
            return 0
        self._note_failures(round_id, decision.missing, decision.mismatched)
        return decision.tokens

    def all_ok(self, round_id: int, ok: bool) -> bool:
        """True on every rank only if every rank's remap of round `round_id` succeeded in time."""
        if not isinstance(ok, bool):
            raise TypeError(f"ok must be a bool (got {type(ok).__name__})")
        self._enter((round_id, 1))
        vetoed = self._vetoed_round == round_id
        if self.world_size == 1:
            return ok
        rolls_back = f"every rank rolls back round {round_id}"
        if self.is_leader:
            votes, strays = self._gather((round_id, 1), self._follower_ranks(), self.timeout_s)
            missing, mismatched = self._absent(votes, strays), tuple(sorted(strays))
            failed = (() if ok else (self.rank,)) + tuple(r for r, vote in votes.items() if not vote.ok)
            commit = not (missing or mismatched or failed or vetoed)
            self._broadcast(Outcome(round_id, commit, missing, mismatched, self._purpose))
            self._log_missing(round_id, missing, "did not vote on", rolls_back)
            self._log_mismatched(round_id, mismatched, rolls_back)
            if failed:
                logger.info("vamp controller: %s voted no on round %d; every rank rolls back",
                            _ranks_text(tuple(sorted(failed))), round_id)
            return commit
        self._send_to_leader(Vote(round_id, self.rank, ok and not vetoed, self._purpose))
        outcomes, strays = self._gather((round_id, 1), (LEADER_RANK,), 2 * self.timeout_s)
        outcome = outcomes.get(LEADER_RANK)
        if outcome is None:
            reason = (self._leader_strayed(round_id, strays) if strays else
                      f"did not send the outcome of round {round_id} within {2 * self.timeout_s:.1f} s")
            logger.warning("vamp controller: rank 0 (leader) %s; rank %d rolls back", reason, self.rank)
            return False
        self._log_missing(round_id, outcome.missing, "did not vote on", rolls_back)
        self._log_mismatched(round_id, outcome.mismatched, rolls_back)
        return outcome.commit

    # --- plumbing ------------------------------------------------------------------------------
    def _follower_ranks(self) -> tuple[int, ...]:
        return tuple(range(1, self.world_size))

    def _absent(self, answered: dict[int, Message], strays: dict[int, str]) -> tuple[int, ...]:
        return tuple(r for r in self._follower_ranks() if r not in answered and r not in strays)

    def _enter(self, stage: Stage) -> None:
        _check_count("round_id", stage[0])
        if stage <= self._last_stage:
            raise ValueError(f"round_id {stage[0]} does not move forward (last round {self._last_stage[0]}); "
                             "use a new, larger round_id for each agree_min")
        self._last_stage = stage
        self._stash = {key: m for key, m in self._stash.items() if key[0] >= stage}

    def _note_failures(self, round_id: int, missing: tuple[int, ...], mismatched: tuple[int, ...]) -> None:
        """A round some rank missed or held for another purpose ends with all_ok False everywhere,
        whatever the callers pass."""
        if missing or mismatched:
            self._vetoed_round = round_id
        self._log_missing(round_id, missing, "did not answer", "no remap on any rank")
        self._log_mismatched(round_id, mismatched, "no remap on any rank")

    def _log_missing(self, round_id: int, missing: tuple[int, ...], verb: str, consequence: str) -> None:
        if missing:
            logger.warning("vamp controller: %s %s round %d within %.1f s; %s", _ranks_text(missing), verb,
                           round_id, self.timeout_s, consequence)

    def _log_mismatched(self, round_id: int, mismatched: tuple[int, ...], consequence: str) -> None:
        if mismatched:
            logger.warning("vamp controller: %s held another round than round %d (%r); %s", _ranks_text(mismatched),
                           round_id, self._purpose, consequence)

    def _leader_strayed(self, round_id: int, strays: dict[int, str]) -> str:
        return f"held round {round_id} for {strays[LEADER_RANK]!r}, not {self._purpose!r}"

    def _gather(self, stage: Stage, senders: tuple[int, ...], wait_s: float) -> Answers:
        """This stage's message from each sender that answers within `wait_s`, stashed ones first; and
        the purpose of each sender that held another round under this stage's id (no use waiting)."""
        got: dict[int, Message] = {}
        strays: dict[int, str] = {}
        for sender in senders:
            if (stage, sender) in self._stash:
                self._file(stage, sender, self._stash.pop((stage, sender)), got, strays)
        deadline = time.monotonic() + wait_s
        while len(got) + len(strays) < len(senders):
            wait_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if wait_ms <= 0 or not self._socket.poll(wait_ms, zmq.POLLIN):
                break
            received = self._receive()
            if received is not None:
                self._file(stage, *received, got, strays)
        return got, strays
    def _receive(self) -> tuple[int, Message] | None:
        """(sender rank, message) for one well-formed message addressed to this rank, else None."""
        frames = self._socket.recv_multipart(zmq.NOBLOCK)
        sender, who = LEADER_RANK, "rank 0 (leader)"
        if self.is_leader:
            match = _ROUTING_ID.fullmatch(frames[0])
            sender = int(match.group(1)) if match else -1
            who = f"rank {sender}" if sender in self._follower_ranks() else f"unknown peer {frames[0]!r}"
            frames = frames[1:]
        try:
            if who.startswith("unknown"):
                raise MalformedMessage("the sender is not a follower rank of this group")
            if len(frames) != 1:
                raise MalformedMessage(f"expected one frame, got {len(frames)}")
            message = decode(frames[0])
            if type(message) not in ((Proposal, Vote) if self.is_leader else (Decision, Outcome)):
                raise MalformedMessage(f"a {type(message).__name__} is never sent to rank {self.rank}")
            if self.is_leader and message.rank != sender:
                raise MalformedMessage(f"{type(message).__name__}.rank is {message.rank} but it came from {who}")
        except MalformedMessage as exc:
            logger.warning("vamp controller: rank %d rejected a malformed message from %s: %s; treated as no "
                           "answer", self.rank, who, exc)
            return None
        return sender, message

    def _file(self, stage: Stage, sender: int, message: Message, got: dict[int, Message],
              strays: dict[int, str]) -> None:
        message_stage = (message.round_id, PHASE_OF[type(message)])
        name = type(message).__name__
        if message_stage < stage:
            logger.warning("vamp controller: rank %d discarded a late %s for round %d from rank %d (now in "
                           "%s of round %d)", self.rank, name, message.round_id, sender,
                           ("agree_min", "all_ok")[stage[1]], stage[0])
        elif message_stage > stage:
            if len(self._stash) >= 4 * self.world_size:  # bound memory against a runaway peer
                self._stash.pop(next(iter(self._stash)))
            self._stash[(message_stage, sender)] = message
        elif sender in got or sender in strays:
            logger.warning("vamp controller: rank %d ignored a second %s for round %d from rank %d",
                           self.rank, name, message.round_id, sender)
        elif message.purpose != self._purpose:
            logger.debug("vamp controller: rank %d got a %s for round %d held for %r from rank %d, not for %r",
                         self.rank, name, message.round_id, message.purpose, sender, self._purpose)
            strays[sender] = message.purpose
        else:
            got[sender] = message

    def _send_to_leader(self, message: Message) -> None:
        try:
            self._socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:  # the leader will count this rank as missing
            logger.warning("vamp controller: rank %d could not queue its %s for round %d", self.rank,
                           type(message).__name__, message.round_id)

    def _broadcast(self, message: Message) -> None:
        payload = encode(message)
        for rank in self._follower_ranks():
            try:
                self._socket.send_multipart([_routing_id(rank), payload], zmq.NOBLOCK)
            except zmq.ZMQError:  # not connected (dead or not started): it times out and takes 0
                logger.debug("vamp controller: rank %d is not connected; no %s sent", rank, type(message).__name__)
