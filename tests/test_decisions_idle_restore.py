"""The idle restore on SGLang's own objects (tests/test_decisions.py's tree, pool and expert memory): it counts
wall-clock idleness, not polls; it never evicts a prefix for a restore that cannot happen; and a missed or lost
agreement round delays it only as long as the back-off says (found by TP2 soaks with agree-timeout faults).
"""

import time
from types import SimpleNamespace

from tests.test_decisions import allocator_context, cache_prompts, maker  # noqa: F401 (fixtures)
from tests.test_integration_memory import fused_shared_experts, sglang_moe, vamp  # noqa: F401 (fixtures)
from vamp_sglang.controller.rounds import ROUND_BACKOFF_STEPS
from vamp_sglang.integration.decisions import restore_trigger


def test_idle_restore_counts_wall_clock_not_polls_and_never_evicts_for_nothing(maker, monkeypatch):  # noqa: F811
    """Issue 9.9: without --sleep-on-idle SGLang polls thousands of times a second; counting polls
    restored (evicting cached prefixes) within milliseconds of every think-time gap."""
    dm = maker.make()
    maker.memory.offload(2, maker.memory.tokens_for(2))
    dm.inputs.refresh_view()
    cache_prompts(maker, 6, 40)  # cached prefixes reach into the tail a restore would drop
    cached = maker.tree.evictable_size()
    for _ in range(5000):  # a spinning scheduler: 5,000 idle polls within a fraction of a second
        dm.restorer.maybe_restore(idle=True)
    assert maker.memory.offloaded_groups == 2 and maker.tree.evictable_size() == cached
    clock = [time.monotonic() + 11.0]
    monkeypatch.setattr(restore_trigger.time, "monotonic", lambda: clock[0])
    dm.restorer.maybe_restore(idle=True)
    assert maker.memory.offloaded_groups < 2  # 11 s of wall-clock idleness: experts come back
    assert dm.log.recent()[-1]["site"] == "restore"


def test_idle_polls_count_towards_the_back_off_after_a_missed_round(maker):  # noqa: F811
    """Found by a TP2 soak with agree-timeout faults: a round missed just before the server went idle
    held rounds back for 256 scheduler steps, an idle server takes none, and its experts never came
    back. The back-off counts idle polls too (replicated like steps: ranks poll in lockstep)."""
    dm = maker.make()
    dm.rounds.controller = SimpleNamespace(world_size=2)  # all `blocked` reads; nothing is offloaded, so
    dm.rounds.blocked_until_step = dm.rounds.step_fn() + ROUND_BACKOFF_STEPS  # no round is held here
    step = dm.runtime.step
    for _ in range(ROUND_BACKOFF_STEPS - 1):
        dm.restorer.maybe_restore(idle=True)
    assert dm.rounds.blocked
    dm.restorer.maybe_restore(idle=True)
    assert not dm.rounds.blocked and dm.runtime.step == step


class PeerAlike:
    """A second TP rank, as the rounds see it: it proposes what this rank does and misses the rounds
    `misses(round_id)` names (a late or lost rank)."""

    world_size, rank, timeout_s = 2, 0, 0.0

    def __init__(self, misses):
        self.misses, self.held = misses, []

    def agree_min(self, round_id, value, purpose=""):
        self.held.append(round_id)
        return value

    def all_ok(self, round_id, ok):
        return ok and not self.misses(round_id)


def test_an_idle_check_after_a_missed_round_does_not_wait_out_the_back_off(maker, monkeypatch):  # noqa: F811
    """Found by a TP2 soak with agree-timeout:0.05: a round missed as the load ended held rounds back
    for 256 ticks; under --sleep-on-idle an idle poll comes about once a second, the idle checks in
    the back-off agreed on 0 s of idleness, and the first past it came at poll 256 or 512: experts
    still offloaded 180 s later. An idle check backs off on its own (doubling poll counts), so it
    holds its round during the back-off, and a round every rank answered ends the back-off."""
    dm = maker.make()
    maker.memory.offload(1, maker.memory.tokens_for(1))
    dm.inputs.refresh_view()
    peer = dm.controller = dm.rounds.controller = PeerAlike(lambda round_id: round_id == peer.held[0])
    clock = [time.monotonic()]
    monkeypatch.setattr(restore_trigger.time, "monotonic", lambda: clock[0])
    dm.restorer.maybe_restore(idle=True)  # poll 1: the idle check's round is missed
    assert dm.rounds.missed == 1 and dm.rounds.blocked
    clock[0] += 11.0
    for _ in range(3):  # polls 2 to 4
        dm.restorer.maybe_restore(idle=True)
    assert maker.memory.offloaded_groups == 0 and not dm.rounds.blocked
    assert dm.log.recent()[-1]["site"] == "restore"


def test_a_lost_rank_costs_an_idle_server_a_round_only_at_its_doubling_idle_checks(maker, monkeypatch):  # noqa: F811
    """The other side of holding idle checks' rounds during the back-off: with a rank gone for good,
    each check waits out a time-out, so they must stay at doubling poll counts (1, 2, 4, ...)."""
    dm = maker.make()
    maker.memory.offload(1, maker.memory.tokens_for(1))
    dm.inputs.refresh_view()
    peer = dm.controller = dm.rounds.controller = PeerAlike(lambda round_id: True)
    clock = [time.monotonic()]
    monkeypatch.setattr(restore_trigger.time, "monotonic", lambda: clock[0])
    for _ in range(64):
        clock[0] += 1.0
        dm.restorer.maybe_restore(idle=True)
    assert len(peer.held) == 7 and maker.memory.offloaded_groups == 1  # polls 1, 2, 4, ..., 64


def test_no_prefix_is_evicted_for_a_restore_that_cannot_happen(maker, monkeypatch):  # noqa: F811
    """Before, the idle restore evicted first and only then found the tail could not be freed."""
    dm = maker.make()
    maker.memory.offload(2, maker.memory.tokens_for(2))
    dm.inputs.refresh_view()
    cache_prompts(maker, 2, 30)  # the tree holds 60 evictable rows
    held = maker.alloc.alloc(maker.alloc.available_size())  # a request holds all the rest, tail included
    assert held is not None
    cached = maker.tree.evictable_size()
    clock = [time.monotonic()]
    monkeypatch.setattr(restore_trigger.time, "monotonic", lambda: clock[0])
    dm.restorer.maybe_restore(idle=True)
    clock[0] += 60
    for _ in range(4):
        dm.restorer.maybe_restore(idle=True)
    assert maker.tree.evictable_size() == cached and maker.memory.offloaded_groups == 2
