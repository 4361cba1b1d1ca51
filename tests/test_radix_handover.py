"""The eviction SGLang runs right after a VAMP decision takes the decision's victims (integration/cache/radix_rust.py).

A decision walks the kept order read-only to price "evict N tokens" (radix_eviction.eviction_candidates); SGLang's
eviction then walked the same order again, pricing the same leaves. On the Rust core's mirror, which sees every
change to the tree, the eviction takes the decision's nodes as long as nothing changed since and the step and
published priors are the decision's; anything else and it walks, as before. Checked here: no walk when they
hold, the same victims as a full re-sort when anything changed between, and lockstep with the Python core
(which always walks) when every eviction follows a decision.
"""

from array import array

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from eval.cachesim.tree import TreeReplay, build, prepare
from tests.test_radix_rust import replay_both, workload
from vamp_sglang.cache import estimate, leaf_order
from vamp_sglang.integration.cache import radix_eviction


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    prepare()


def sessions_tree(turns: int = 6, sessions: int = 8):
    """A Rust-core cache holding `sessions` chains of `turns` turns (each turn a node), a step apart, and a
    function that counts the walks opened while it is on."""
    cache, allocator, step = build("vamp-rust", 4096)
    replay = TreeReplay(cache, allocator)
    histories = [[1000 * s + t for t in range(4)] for s in range(sessions)]
    for turn in range(turns):
        for history in histories:
            step[0] += 1
            history.extend(range(100 * turn + 10, 100 * turn + 10 + 5 + (len(history) % 7)))
            admission = replay.admit(history, len(history))
            replay.finish(admission, history)
    return cache, step, replay, histories


def victims_of(cache, n_tokens: int) -> list[int]:
    """What a heap over every evictable leaf takes for `n_tokens` now (SGLang's own walk), node ids."""
    core = cache.tree_core
    return [n.id for n in estimate(radix_eviction._MirrorView(core), n_tokens, lambda n: 0.0).nodes]


def evicted_ids(cache, n_tokens: int, monkeypatch) -> tuple[list[int], int]:
    """(node ids the eviction of `n_tokens` freed, in order; walks it opened)."""
    core, freed, walks = cache.tree_core, [], []
    evict_leaf = type(core).evict_device_leaf
    monkeypatch.setattr(type(core), "evict_device_leaf",
                        lambda self, node_id, wb: freed.append(node_id) or evict_leaf(self, node_id, wb))
    opened = leaf_order.OrderedWalk.__init__
    monkeypatch.setattr(leaf_order.OrderedWalk, "__init__", lambda self, *a: walks.append(1) or opened(self, *a))
    cache.evict(EvictParams(num_tokens=n_tokens))
    monkeypatch.undo()
    return freed, len(walks)


def test_the_eviction_after_a_decision_takes_its_victims_without_walking(monkeypatch):
    cache, step, _, _ = sessions_tree()
    step[0] += 1
    candidates = radix_eviction.eviction_candidates(cache, 120, 0, 1, 4)
    expected = victims_of(cache, 120)
    assert sum(c.tokens for c in candidates) >= 120 and len(expected) > 3
    freed, walks = evicted_ids(cache, 120, monkeypatch)
    assert freed == expected
    assert walks == 0, "the eviction walked the order again"
    order = cache.tree_core.vamp_leaf_order  # the victims' dead heap entries went with the eviction, as a walk's do
    assert all(order.entries.get(heap[0][2], (None, None))[1] is heap[0] for heap in order.groups.values() if heap)


def test_an_eviction_asking_more_than_the_decision_covered_walks_on_from_its_victims(monkeypatch):
    cache, step, _, _ = sessions_tree()
    step[0] += 1
    radix_eviction.eviction_candidates(cache, 60, 0, 1, 4)
    expected = victims_of(cache, 300)
    freed, walks = evicted_ids(cache, 300, monkeypatch)
    assert freed == expected and walks == 1


def _lock_a_predicted_parent(cache, step, replay, histories):
    # a request now holds a node the decision named that was no leaf: a parent its walk freed by taking one below
    taken = cache.tree_core.vamp_victims[2]
    cache.lock(next(n for i, n in enumerate(taken) if any(m.parent is n for m in taken[:i])).id)


def _a_turn_extends_a_session(cache, step, replay, histories):
    histories[1].extend(range(7000, 7010))
    replay.finish(replay.admit(histories[1], len(histories[1])), histories[1])


def _an_admission_counts_hits(cache, step, replay, histories):
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", histories[2]))))
    cache.tree_core.record_admission(match.last_device_node, match.device_prefix_len, len(histories[2]), True)


def _the_step_moves_on(cache, step, replay, histories):
    step[0] += 500


@pytest.mark.parametrize("change", [_lock_a_predicted_parent, _a_turn_extends_a_session, _an_admission_counts_hits,
                                    _the_step_moves_on])
def test_a_change_between_the_decision_and_the_eviction_makes_it_walk(change, monkeypatch):
    cache, step, replay, histories = sessions_tree()
    step[0] += 1
    radix_eviction.eviction_candidates(cache, 200, 0, 1, 4)
    change(cache, step, replay, histories)
    expected = victims_of(cache, 200)
    freed, walks = evicted_ids(cache, 200, monkeypatch)
    assert freed == expected and walks == 1


def test_a_decision_hands_its_victims_to_one_eviction_only(monkeypatch):
    cache, step, _, _ = sessions_tree()
    step[0] += 1
    radix_eviction.eviction_candidates(cache, 100, 0, 1, 4)
    evicted_ids(cache, 100, monkeypatch)
    expected = victims_of(cache, 100)
    freed, walks = evicted_ids(cache, 100, monkeypatch)
    assert freed == expected and walks == 1


@pytest.mark.parametrize("seed,in_flight", [(3, 2), (10, 5)])
def test_with_a_decision_before_every_eviction_the_rust_core_evicts_as_the_python_core_does(seed, in_flight):
    evicted_tokens, _ = replay_both(workload(seed, 300), 1024, in_flight, decide_first=True)
    assert evicted_tokens > 2000, "the pool hardly fell short: little was compared"
