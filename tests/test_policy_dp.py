"""DP attention in the decision core: C_e charged on the global step, and the restore over the SLO.

The step waits for the DP rank that stages most, so a rank pays Eq. 3 only for the groups it adds above
the other DP ranks' offloads, and only the rank(s) staging most restore over the TPOT SLO.
"""

import pytest
from test_policy_planner import snap
from test_restore_plan import plan as restore_plan

from vamp_sglang.policy import Coefficients, DpStep, Snapshot, SnapshotError, dp_charged_groups, plan

C = Coefficients()
EVICTABLE = [(150, 0, 4000), (64, 1, 100), (200, 5, 10)]  # test_policy_planner's worked example


@pytest.mark.parametrize("n, own, peers, charged", [
    (4, 0, 0, 4),  # no peer ahead: Eq. 3 as the paper has it
    (4, 8, 3, 4),  # this rank stages most already: every added group lengthens the step
    (4, 0, 8, 0),  # a peer stages 8: up to 8 here lengthens nothing
    (4, 6, 8, 2),  # 6 + 4 = 10 passes the peer's 8 by 2
    (0, 2, 9, 0),
])
def test_a_rank_pays_only_for_the_groups_above_the_other_dp_ranks(n, own, peers, charged):
    assert dp_charged_groups(n, own, peers) == charged


def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="counts >= 0"):
        dp_charged_groups(1, -1, 0)


def test_without_a_peer_ahead_the_price_is_the_single_rank_price():
    alone = plan(snap(300, EVICTABLE), C)
    behind_nobody = plan(snap(300, EVICTABLE, dp_step={"offloaded_groups": 4, "peer_offloaded_groups": 4}), C)
    assert behind_nobody.costs == alone.costs and behind_nobody.action == alone.action == "evict"


def test_a_peer_that_offloaded_more_makes_offloading_free_here_and_turns_eviction_into_offload():
    # the worked example: 8 groups cost 18,900 us and eviction wins at 2,128 us; with a peer at 8 groups
    # the same 8 groups lengthen no step, so offload costs nothing and wins
    p = plan(snap(300, EVICTABLE, dp_step={"offloaded_groups": 0, "peer_offloaded_groups": 8}), C)
    assert (p.action, p.groups) == ("offload", 8) and p.costs["offload"] == 0.0
    # a peer at 6: two of the eight groups are charged, a quarter of the single-rank price
    part = plan(snap(300, EVICTABLE, dp_step={"offloaded_groups": 0, "peer_offloaded_groups": 6}), C)
    assert part.costs["offload"] == pytest.approx(18900e-6 / 4)
    # combined's floor (4 groups) lies under the peer's 6: only its eviction remainder is paid
    assert part.costs["combined"] == pytest.approx(137.5e-6)


def test_dp_step_round_trips_and_is_validated_by_name():
    s = snap(300, EVICTABLE, dp_step={"offloaded_groups": 3, "peer_offloaded_groups": 5})
    assert s.dp_step == DpStep(3, 5)
    assert Snapshot.from_json(s.to_json()) == s
    assert "dp_step" not in snap(300, EVICTABLE).to_json()
    with pytest.raises(SnapshotError, match=r"snapshot.dp_step.peer_offloaded_groups must be a non-negative"):
        snap(300, EVICTABLE, dp_step={"offloaded_groups": 3, "peer_offloaded_groups": -1})
    with pytest.raises(SnapshotError, match="snapshot.dp_step has unknown field 'ranks'"):
        snap(300, EVICTABLE, dp_step={"offloaded_groups": 3, "peer_offloaded_groups": 1, "ranks": 2})


def test_over_the_slo_only_the_rank_that_stages_most_restores():
    over = {"tpot_over_slo": True, "offloaded_groups": 8}
    assert restore_plan(**over).groups == 4  # no DP attention
    assert restore_plan(**over, peer_offloaded_groups=3).groups == 4  # this rank is the straggler
    assert restore_plan(**over, peer_offloaded_groups=8).groups == 4  # a tie: every rank at the top restores
    behind = restore_plan(**over, peer_offloaded_groups=12)
    assert behind.groups == 0 and "another DP rank stages more (12 > 8 groups)" in behind.reason


def test_calm_and_idle_restores_stay_per_rank():
    assert restore_plan(calm_steps=100, offloaded_groups=8, peer_offloaded_groups=12).groups == 4
    assert restore_plan(idle=True, idle_s=30.0, offloaded_groups=8, peer_offloaded_groups=12).groups == 4
