"""DP attention: each DP rank's attention-TP group holds its own rounds, over real ipc sockets.

`round_group` maps SGLang's ranks to round groups; the socket tests run one thread per rank, two DP
groups of two attention-TP ranks in one private ipc dir (as one server's scheduler processes share
it). Time-outs are 0.3 s; no assertion is about elapsed time, only about what each round agreed and
whether any rank was reported missing.
"""

import logging
import shutil
import threading

import pytest

from vamp_sglang.controller import RankController, make_private_ipc_dir
from vamp_sglang.controller.groups import RoundGroup, round_group
from vamp_sglang.controller.rounds import RankRounds

TIMEOUT_S = 0.3
JOIN_GUARD_S = 60  # a hang guard, not a timing assertion


# --- who is in which group ----------------------------------------------------------------------
def test_under_dp_attention_the_group_is_the_dp_ranks_attention_tp_group():
    # tp 4, dp 2: attention-TP 2, ranks (0, 1) hold DP rank 0's pool and (2, 3) DP rank 1's
    groups = [round_group(r, 4, 2, dp_attention=True) for r in range(4)]
    assert groups == [RoundGroup(0, 2, 0, 0), RoundGroup(1, 2, 0, 0), RoundGroup(0, 2, 1, 1), RoundGroup(1, 2, 1, 1)]


def test_attention_tp_1_means_one_rank_groups_and_no_round():
    # the DeepSeek/Kimi preset, tp 8 dp 8: every DP rank decides alone
    groups = [round_group(r, 8, 1, dp_attention=True) for r in range(8)]
    assert [(g.rank, g.world_size, g.dp_rank) for g in groups] == [(0, 1, r) for r in range(8)]
    assert len({g.group_id for g in groups}) == 8
    with RankController(0, groups[5].world_size, None) as alone:  # no ipc dir needed: no socket
        assert RankRounds(alone, lambda: 0).agree(7) == 7


def test_without_dp_attention_the_whole_tp_group_agrees_and_replicas_keep_apart():
    assert [round_group(r, 2, 2, dp_attention=False) for r in range(2)] == [RoundGroup(0, 2, 0, None),
                                                                            RoundGroup(1, 2, 0, None)]
    # plain --dp-size replicas: one TP group per replica, each with its own leader socket
    assert round_group(0, 2, 2, dp_attention=False, replica_dp_rank=1) == RoundGroup(0, 2, 1, 1)


def test_attention_cp_peers_share_their_dp_ranks_round():
    # tp 8, dp 2, attention-CP 2, attention-TP 2: ranks (dp, cp, tp) with tp fastest; the CP peers of one DP
    # rank run its batch on its pool, and SGLang checks they agree, so they agree on its pool size too
    groups = [round_group(r, 8, 2, dp_attention=True, attn_cp_size=2) for r in range(8)]
    assert [g.group_id for g in groups] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.dp_rank for g in groups] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [(g.rank, g.world_size) for g in groups] == [(r % 4, 4) for r in range(8)]


def test_bad_topologies_are_named():
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 4\) \(got 4\)"):
        round_group(4, 4, 2, dp_attention=True)
    with pytest.raises(ValueError, match="attention-TP size 3 x attention-CP size 1 must divide the TP size 4"):
        round_group(0, 4, 3, dp_attention=True)


# --- independent rounds over real sockets --------------------------------------------------------
class _Missing(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(ipc_dir, scripts):
    """scripts: tp_rank -> list of (round_id, tokens); tp 4, dp 2. Each rank holds agree_min then all_ok
    per round in its own thread, in its group's controller. Returns tp_rank -> agreed values."""
    results, errors = {}, []

    def rank_main(tp_rank, rounds):
        group = round_group(tp_rank, 4, 2, dp_attention=True)
        try:
            with RankController(group.rank, group.world_size, ipc_dir, TIMEOUT_S, group_id=group.group_id) as ctl:
                agreed = []
                for round_id, tokens in rounds:
                    value = ctl.agree_min(round_id, tokens, "remap/offload")
                    agreed.append((value, ctl.all_ok(round_id, True)))
                results[tp_rank] = agreed
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r, s)) for r, s in scripts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_GUARD_S)
    assert not errors and not any(t.is_alive() for t in threads)
    return results


@pytest.fixture
def ipc_dir():
    path = make_private_ipc_dir()
    yield path
    shutil.rmtree(path)


@pytest.fixture
def missing():
    handler = _Missing()
    log = logging.getLogger("vamp_sglang.controller")
    log.addHandler(handler)
    yield handler.lines
    log.removeHandler(handler)


def test_two_dp_groups_agree_on_their_own_minimum_with_their_own_round_counts(ipc_dir, missing):
    # DP rank 0 is short three times, DP rank 1 once, at round ids of its own: neither sees the other's
    scripts = {0: [(1, 40), (2, 8), (3, 100)], 1: [(1, 60), (2, 5), (3, 90)], 2: [(7, 300)], 3: [(7, 200)]}
    results = _run(ipc_dir, scripts)
    assert results == {0: [(40, True), (5, True), (90, True)], 1: [(40, True), (5, True), (90, True)],
                       2: [(200, True)], 3: [(200, True)]}
    assert missing == []


def test_a_dp_group_whose_ranks_never_hold_a_round_delays_no_other_group(ipc_dir, missing):
    # DP rank 1's ranks never reach the funnel (its pool is never short): DP rank 0 agrees every round,
    # with no rank reported missing; rounds spanning the TP group would have agreed 0 after time-outs
    scripts = {0: [(1, 40), (2, 8)], 1: [(1, 60), (2, 5)]}
    assert _run(ipc_dir, scripts) == {0: [(40, True), (5, True)], 1: [(40, True), (5, True)]}
    assert missing == []


# --- across nodes ----------------------------------------------------------------------------------
def test_across_nodes_a_dp_group_whose_leader_is_not_on_node_0_is_refused_before_anything_loads():
    from vamp_sglang import launch_server
    from vamp_sglang.config import ConfigError

    argv = ["--model-path", "models/tiny-qwen3-moe", "--device", "cpu", "--nnodes", "2", "--tp-size", "4",
            "--enable-dp-attention", "--dist-init-addr", "127.0.0.1:25000"]
    # tp 4 over 2 nodes, dp 2: DP rank 1's leader is TP rank 2, on node 1
    with pytest.raises(ConfigError, match=r"DP rank 1's controller leader \(attention-TP rank 0, TP rank 2\) on node 1"):
        launch_server.prepare([*argv, "--dp-size", "2"])
    plain = [a for a in argv if a != "--enable-dp-attention"]  # SGLang 0.5.23's own spelling of the same
    with pytest.raises(ConfigError, match=r"--attn-dp-size 2 with --nnodes 2 puts DP rank 1's controller leader"):
        launch_server.prepare([*plain, "--attn-dp-size", "2"])
    # attention-TP 1: no rounds, so only the usual multi-node checks remain (here: the key file)
    with pytest.raises(ConfigError, match="--vamp-controller-key-file"):
        launch_server.prepare([*argv, "--dp-size", "4"])
