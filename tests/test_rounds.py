"""RankRounds over real ipc sockets, one thread per rank: rounds a rank held alone or skipped.

A rank whose control flow strayed (a decision-log write that raised before a round, say) holds one
round more or one fewer than the others. Each rank follows a script; `at_tick(n)` is the step
boundary: both ranks wait for each other there (as SGLang's collectives make them) and move their
replicated tick to n. Time-outs are 0.2 s; no assertion is about elapsed time.
"""

import logging
import shutil
import threading
from collections.abc import Callable

import pytest

from vamp_sglang.controller import RankController, make_private_ipc_dir
from vamp_sglang.controller.rounds import ROUND_BACKOFF_STEPS, RankRounds

TIMEOUT_S = 0.2
JOIN_GUARD_S = 60  # a hang guard, not a timing assertion
PAST_BACKOFF = ROUND_BACKOFF_STEPS + 1  # ticks between the script's step boundaries


class _AtTick:
    def __init__(self, tick: int) -> None:
        self.tick = tick


def at_tick(n: int) -> _AtTick:
    """A step boundary: wait for the other rank, then move this rank's tick to `n` back-offs on."""
    return _AtTick(n * PAST_BACKOFF)


class Ranks:
    """Two ranks' RankRounds over real ipc sockets, each with its own replicated tick."""

    def __init__(self, ipc_dir: str) -> None:
        self.ticks = [0, 0]
        self.controllers = [RankController(rank, 2, ipc_dir, TIMEOUT_S) for rank in range(2)]
        self.rounds = [RankRounds(ctl, lambda rank=rank: self.ticks[rank]) for rank, ctl in enumerate(self.controllers)]

    def run(self, scripts: list[list[Callable[[RankRounds], object] | _AtTick]]) -> list[list[object]]:
        """Each rank's results, one per call of its script."""
        boundary = threading.Barrier(2)
        results: list[list[object]] = [[], []]

        def follow(rank: int) -> None:
            for step in scripts[rank]:
                if isinstance(step, _AtTick):
                    boundary.wait(JOIN_GUARD_S)
                    self.ticks[rank] = step.tick
                else:
                    results[rank].append(step(self.rounds[rank]))

        threads = [threading.Thread(target=follow, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_GUARD_S)
        assert not any(thread.is_alive() for thread in threads)
        return results


@pytest.fixture
def ranks():
    ipc_dir = make_private_ipc_dir()
    both = Ranks(ipc_dir)
    yield both
    for ctl in both.controllers:
        ctl.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)


def agree(value: int, **kwargs: object) -> Callable[[RankRounds], int]:
    return lambda rounds: rounds.agree(value, **kwargs)


def all_equal(value: int, **kwargs: object) -> Callable[[RankRounds], bool]:
    return lambda rounds: rounds.all_equal(value, **kwargs)


class Pool:
    """What one rank's remaps leave it holding: applied minus undone."""

    def __init__(self) -> None:
        self.held = 0
        self.last = 0

    def apply(self, amount: int) -> None:
        self.held, self.last = self.held + amount, amount

    def undo(self) -> None:
        self.held -= self.last

    def remap(self, proposal: int, **kwargs: object) -> Callable[[RankRounds], int]:
        return lambda rounds: rounds.remap(proposal, self.apply, self.undo, **kwargs)


# --- item 8: rounds realign after one rank held a round more or fewer --------------------------------
def test_after_one_rank_held_an_extra_round_the_next_ticks_rounds_agree_again(ranks):
    """Before, round ids were a bare per-rank count: rank 1's extra round put it one id ahead for good,
    and every later round agreed 0 on both ranks."""
    leader = [agree(40), at_tick(1), agree(40), at_tick(2), agree(40)]
    follower = [all_equal(7), agree(30), at_tick(1), agree(30), at_tick(2), agree(30)]
    results = ranks.run([leader, follower])
    assert results[0][1:] == [30, 30]
    assert results[1][2:] == [30, 30]


def test_after_one_rank_skipped_a_round_the_next_ticks_rounds_agree_again(ranks):
    leader = [agree(40), agree(41), at_tick(1), agree(40), at_tick(2), agree(40)]
    follower = [agree(30), at_tick(1), agree(30), at_tick(2), agree(30)]
    results = ranks.run([leader, follower])
    assert results[0] == [30, 0, 30, 30]  # its second round was its own: no rank answered it
    assert results[1] == [30, 30, 30]


def test_a_round_held_for_another_call_never_remaps_one_rank_only(ranks):
    """Rank 1 skipped an agree round, so its remap round had the id of rank 0's agree round. Before,
    the ids matched, rank 0 agreed on min(1, 100) and rank 1 kept a remap of 1 that rank 0 never made."""
    pools = [Pool(), Pool()]
    results = ranks.run([[agree(1), pools[0].remap(100)], [pools[1].remap(100)]])
    assert [pool.held for pool in pools] == [0, 0]
    assert results == [[0, 0], [0]]
    results = ranks.run([[at_tick(1), pools[0].remap(100)], [at_tick(1), pools[1].remap(100)]])
    assert [pool.held for pool in pools] == [100, 100] and results == [[100], [100]]


def test_rounds_of_one_kind_from_two_call_sites_never_mix_their_values(ranks):
    """Rank 1 skipped the guard's round: its view round has the guard round's id. Without purposes the
    ranks would agree min(5, 30) = 5 and use it as a guard cap on rank 0 and as a view on rank 1."""
    leader = [agree(5, purpose="guard"), agree(40, purpose="view"), at_tick(1), agree(40, purpose="view")]
    follower = [agree(30, purpose="view"), at_tick(1), agree(30, purpose="view")]
    assert ranks.run([leader, follower]) == [[0, 0, 30], [0, 30]]


def test_a_purpose_is_a_short_call_site_name_checked_on_one_rank_too():
    with RankController(0, 1, None) as alone:
        rounds = RankRounds(alone, lambda: 0)
        assert rounds.agree(3, purpose="offload-state") == 3
        for bad in ("Offload", "agree/view", "x" * 30):
            with pytest.raises(ValueError, match="purpose must be a short call-site name"):
                rounds.agree(3, purpose=bad)


# --- item 9: all_equal backs off like agree -------------------------------------------------------
def test_all_equal_holds_no_round_during_the_back_off_after_a_missed_round(caplog):
    """Before, all_equal held its round during the back-off, so with a rank lost every state-slot
    shortfall's fingerprint check waited out the time-outs."""
    ipc_dir = make_private_ipc_dir()
    try:
        with RankController(0, 2, ipc_dir, TIMEOUT_S) as alone, caplog.at_level(logging.WARNING):
            rounds = RankRounds(alone, lambda: 0)  # rank 1 never starts
            assert rounds.agree(5) == 0 and rounds.blocked
            held = rounds.round_id
            assert rounds.all_equal(5) is False
            assert rounds.round_id == held
            assert caplog.text.count("rank 1 did not answer round") == 1
            assert rounds.all_equal(5, despite_backoff=True) is False  # a caller may still opt in
            assert rounds.round_id > held
    finally:
        shutil.rmtree(ipc_dir)
