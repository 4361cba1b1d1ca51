"""A mirror that stops following SGLang's Rust core must not take the server down (integration/cache/radix_rust.py).

The mirror follows the Rust core's tree through its keys; a defect there (a node it never filed, a path it read
wrong) used to raise inside SGLang's own calls: a match, an insert, a lock, an admission, or an eviction already
half done in the Rust core. Now the first such error ends VAMP's order on that tree: it is logged once, the
mirror is dropped, and SGLang's Rust core evicts in its own LRU order (kept all along) from then on; the
planner's candidates say why they cannot be read, so every later decision falls back to SGLang's eviction
(`decision_errors`), and `/vamp/stats` reports it. Here a mirror is broken on purpose (a node taken out of it,
as a missed split would leave it) at each kind of call, and the cache must go on serving requests.
"""

import random
from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from eval.cachesim.tree import TreeReplay, build, prepare
from vamp_sglang.integration.cache import radix_backend, radix_eviction

POOL_TOKENS = 600


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    prepare()


def serve(replay, step, histories, rng, requests: int) -> int:
    """`requests` session turns (each extends its history), one at a time; returns the tokens they hit."""
    hit = 0
    for _ in range(requests):
        step[0] += 1
        history = rng.choice(histories)
        history.extend(rng.randrange(1000) for _ in range(rng.randint(5, 30)))
        if len(history) > 250:
            del history[20:]
        admission = replay.admit(history, len(history))
        assert admission is not None, "a request that fits the pool was refused"
        hit += admission.prefix_len
        replay.finish(admission, history)
    return hit


def filled():
    cache, allocator, step = build("vamp-rust", POOL_TOKENS)
    replay, rng = TreeReplay(cache, allocator), random.Random(0)
    histories = [[1000 + 100 * s + i for i in range(12)] for s in range(5)]
    serve(replay, step, histories, rng, 40)
    assert replay.evicted_tokens > 0, "the pool never fell short: nothing was evicted yet"
    return cache, step, replay, histories, rng


def _forget_a_leaf(core):  # a later match files it again as a split of itself; an eviction names a node it lost
    core.vamp_mirror.pop(next(iter(core.evictable_device_leaves)).id)


def _miscount_a_leaf(core):  # nothing raises: the eviction frees other than the mirror says
    for leaf in core.evictable_device_leaves:
        leaf.tokens += 3


@pytest.mark.parametrize("break_mirror", [_forget_a_leaf, _miscount_a_leaf])
def test_a_broken_mirror_hands_eviction_to_sglang_and_the_cache_serves_on(break_mirror, caplog):
    cache, step, replay, histories, rng = filled()
    core = cache.tree_core
    break_mirror(core)
    evicted_before = replay.evicted_tokens
    hit = serve(replay, step, histories, rng, 60)
    assert core.vamp_lost, "the mirror's error was not noticed"
    assert replay.evicted_tokens > evicted_before and hit > 0  # SGLang's own order evicts, and prefixes still hit
    assert sum("stopped following" in r.getMessage() for r in caplog.records) == 1  # logged once
    with pytest.raises(RuntimeError, match="SGLang's own eviction"):
        radix_eviction.eviction_candidates(cache, 100, 0, 1, 4)
    stats = radix_backend.radix_stats(cache)
    assert stats["tree_core"] == "rust" and stats["mirror_lost"] == core.vamp_lost


def test_an_eviction_the_mirror_fails_in_is_finished_by_sglangs_order():
    """The error comes after the Rust core evicted a node the order named: the rest of that eviction is SGLang's."""
    cache = filled()[0]
    core = cache.tree_core
    _forget_a_leaf(core)
    evictable = core.evictable_size()
    freed = cache.evict(EvictParams(num_tokens=evictable // 2)).num_tokens_evicted
    assert core.vamp_lost and freed >= evictable // 2


def test_a_reset_tree_is_followed_again():
    """SGLang's /flush_cache empties the Rust core's tree: the mirror, empty too, follows it again."""
    cache, step, replay, histories, rng = filled()
    core = cache.tree_core
    _forget_a_leaf(core)
    serve(replay, step, histories, rng, 20)
    assert core.vamp_lost
    cache.reset()
    replay.allocator.clear()  # as SGLang's flush_cache frees the pool with the tree
    assert core.vamp_lost is None
    serve(replay, step, histories, rng, 40)
    assert core.vamp_lost is None and core.device_nodes()
    assert radix_eviction.eviction_candidates(cache, 100, 0, 1, 4)


@pytest.mark.parametrize("where", ["walk", "next"])
def test_an_error_in_vamps_own_walk_hands_the_eviction_to_sglang(where, monkeypatch):
    """The kept order itself raising as an eviction starts (outside SGLang's try/finally) or as it names a victim."""
    cache, step, replay, histories, rng = filled()
    core = cache.tree_core
    step[0] += 1  # no decision's victims to take: the eviction walks

    def broken(*args, **kwargs):
        raise RuntimeError("a defect in the kept order")

    if where == "walk":
        monkeypatch.setattr(core.vamp_leaf_order, "walk", broken)
    else:
        from vamp_sglang.cache import leaf_order

        monkeypatch.setattr(leaf_order.OrderedWalk, "__next__", broken)
    evictable = core.evictable_size()
    freed = cache.evict(EvictParams(num_tokens=evictable // 2)).num_tokens_evicted
    assert core.vamp_lost and freed >= evictable // 2
    monkeypatch.undo()
    assert serve(replay, step, histories, rng, 20) > 0


def test_an_inner_node_the_mirror_takes_for_a_leaf_is_never_named():
    """Found by a review: a mirror that missed a child takes its parent for a leaf; naming that parent to SGLang's
    eviction would make the Rust core panic, and its poisoned lock would refuse every later call. The mirror's
    evictable tokens no longer match the Rust core's, so the eviction ends VAMP's order before naming anything."""
    cache, step, replay, histories, rng = filled()
    core = cache.tree_core
    leaf = next(n for n in core.evictable_device_leaves if n.parent.parent is not None)
    parent = leaf.parent
    del parent.children[leaf.child_key]  # as if the mirror had never filed it
    core.vamp_mirror.pop(leaf.id)
    core.evictable_device_leaves.discard(leaf)
    core.vamp_evictable_tokens -= leaf.tokens
    parent.vamp_stats.last_step = -100  # first in the order
    core._refile(parent)
    cache.evict(EvictParams(num_tokens=core.evictable_size() // 2))
    assert "the mirror holds" in core.vamp_lost and serve(replay, step, histories, rng, 20) > 0


def test_a_lock_the_mirror_missed_is_never_evicted():
    """A request's lock the mirror did not count: the locked leaf looks evictable to it, but not to the Rust core."""
    cache, step, replay, histories, rng = filled()
    core = cache.tree_core
    leaf = next(iter(core.evictable_device_leaves))
    super(type(core), core).inc_lock_ref(leaf.id)  # the Rust core's lock alone
    evictable = core.evictable_size()  # the Rust core's count: the locked leaf is not in it
    freed = cache.evict(EvictParams(num_tokens=evictable)).num_tokens_evicted
    # Had VAMP named the leaf, the Rust core would have panicked; the count check lost the mirror first, and
    # the Rust core's own order then finished the eviction: all it could free, at once
    assert "the mirror holds" in core.vamp_lost
    assert freed == evictable and core.evictable_size() == 0
    assert serve(replay, step, histories, rng, 20) > 0


def test_a_missed_node_and_a_missed_lock_of_one_size_are_caught_together():
    """Two defects whose evictable tokens offset (found by a review): a node the mirror never filed, and a lock it
    did not count on a leaf of the same size. The protected tokens still differ."""
    cache, step, replay, histories, rng = filled()
    core = cache.tree_core
    cache.evict(EvictParams(num_tokens=40))  # room for three writes of 10, 5 and 5 tokens
    for tokens in ([5000 + i for i in range(10)], [5000 + i for i in range(15)], [6000 + i for i in range(5)]):
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        prefix = cache.path_device_indices(match.last_device_node)[:match.device_prefix_len]
        new = replay.allocator.alloc(len(tokens) - match.device_prefix_len)
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=torch.cat([prefix, new]),
                                  prev_prefix_len=match.device_prefix_len))
    first_token = {n.key.token_ids[n.start]: n for n in core.evictable_device_leaves}
    missed, locked = first_token[5010], first_token[6000]  # 5 tokens each; the first under a 10-token node
    del missed.parent.children[missed.child_key]  # never filed: its parent looks like a leaf
    core.vamp_mirror.pop(missed.id)
    core.evictable_device_leaves.discard(missed)
    core.vamp_evictable_tokens -= missed.tokens
    core._refile(missed.parent)
    super(type(core), core).inc_lock_ref(locked.id)  # the Rust core's lock alone
    assert core.vamp_evictable_tokens == core.full_evictable_size()  # the evictable tokens agree
    cache.evict(EvictParams(num_tokens=core.evictable_size()))
    assert "the mirror holds" in core.vamp_lost
    assert serve(replay, step, histories, rng, 20) > 0


def test_compaction_never_moves_a_node_whose_lock_the_mirror_missed():
    """Found by a review: compaction (restoring experts) moves the rows of the nodes the mirror lists as unlocked. A
    lock only the Rust core took would have handed a running request's rows to it; the counts are checked there
    too, and the mirror lost, so nothing is offered and the tail is not movable."""
    from vamp_sglang.integration.memory import compaction

    cache, step, replay, histories, rng = filled()
    core = cache.tree_core
    leaf = next(iter(core.evictable_device_leaves))
    super(type(core), core).inc_lock_ref(leaf.id)  # the Rust core's lock alone
    assert core.unlocked_device_values() == []
    assert "the mirror holds" in core.vamp_lost
    assert not compaction.tail_is_movable(cache, replay.allocator, 0)
    assert serve(replay, step, histories, rng, 20) > 0
