"""VAMP's order beside SGLang's Rust tree core (integration/cache/radix_rust.py) against VAMP's Python tree core.

Both cores get the same requests through SGLang's real `UnifiedRadixCache` (eval/cachesim/tree.py's
`TreeReplay`: match, lock, admission, eviction of the shortfall, insert, unlock), with several requests in
flight, partial matches and inserts that split nodes, and request priorities. After every request both must
hold the same nodes with the same statistics, give the same prefix hits and have evicted the same tokens, and
the mirror must agree with the Rust core's own tree: every node's parent, span and child count
(`collect_path_info`), and the evictable leaves (no child, no lock); the decision's read-only walk must name the
same eviction candidates and price (radix_eviction.py).
"""

import random
from array import array

import pytest
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from eval.cachesim.tree import TreeReplay, build, prepare
from vamp_sglang.cache import CostOrder
from vamp_sglang.integration.cache import radix_backend, radix_eviction
from vamp_sglang.integration.cache.radix_rust import MirrorNode, VampRustTreeCore
from vamp_sglang.policy.costs import Coefficients


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    prepare()


def workload(seed: int, requests: int) -> list[tuple[str, list[int], int]]:
    """(kind, tokens, priority): session turns that extend their history, one-shot prompts, regenerated turns
    (admitted while the turn they branch from may still be in flight: its insert then splits the node the
    other inserted), and probes that match part of a cached history (splitting a node where they stop inside
    it) without being admitted."""
    rng = random.Random(seed)
    histories = [[rng.randrange(500) for _ in range(rng.randint(8, 40))] for _ in range(6)]
    ops = []
    for _ in range(requests):
        roll = rng.random()
        history = rng.choice(histories)
        if roll < 0.5:
            history.extend(rng.randrange(500) for _ in range(rng.randint(2, 24)))
            if len(history) > 160:
                del history[rng.randint(4, 40):]  # the session starts over from part of its history
            ops.append(("turn", list(history), rng.choice((0, 0, 0, 1, 2))))
        elif roll < 0.65:
            ops.append(("one-shot", [rng.randrange(500) for _ in range(rng.randint(4, 60))], rng.choice((0, 0, 1))))
        elif roll < 0.8:  # a regenerated turn: part of the history, then new tokens (a split where it stops)
            cut = rng.randint(1, len(history))
            ops.append(("branch", history[:cut] + [rng.randrange(500, 600) for _ in range(rng.randint(1, 12))], 0))
        else:
            ops.append(("probe", history[:rng.randint(1, len(history))] + [rng.randrange(500, 600)], 0))
    return ops


def check_mirror(core: VampRustTreeCore) -> None:
    """The mirror is the Rust core's tree: parents, spans, child counts; its leaf set is exact."""
    nodes = core.device_nodes()
    if not nodes:
        assert not core.evictable_device_leaves
        return
    paths = core.collect_path_info([n.id for n in nodes])
    for node, path in zip(nodes, paths):
        info = path[-1]
        assert info.node_id == node.id
        assert info.parent_id == node.parent.id, (node.id, info)
        assert info.full_value_len == node.tokens == info.path_end - info.path_start, (node.id, info)
        assert info.num_children == len(node.children), (node.id, info)
        assert node.lock_ref >= 0
        assert node.parent.children[node.child_key] is node  # the key an eviction removes it by
        assert node.child_key == node.key.child_key_at(node.start, core.page_size)
    leaves = {n for n in nodes if not n.children and not n.lock_ref}
    assert set(core.evictable_device_leaves) == leaves
    # the count an eviction checks before it names anything (`evict_device_start`): exact, not just in sum
    counted = (core.vamp_evictable_tokens, core.vamp_protected_tokens)
    assert counted == (sum(n.tokens for n in nodes if not n.lock_ref), sum(n.tokens for n in nodes if n.lock_ref))
    assert counted == (core.full_evictable_size(), core.full_protected_size())


def node_statistics(core) -> dict[tuple, tuple]:
    """Every cached node by the tokens from the root to its end: (its tokens, hits, last use, creation, writer's
    rate, request priority), for either core (`vamp_node` is a Python tree node or a mirror node)."""
    out = {}
    for node in core.device_nodes():
        ends, above = [], node
        while above.parent is not None:
            ends.append(above)
            above = above.parent
        if isinstance(node, MirrorNode):
            path = tuple(node.key.token_ids[:node.start + node.tokens])
        else:
            path = tuple(t for n in reversed(ends) for t in n.key.token_ids)
        stats = node.vamp_stats
        out[path] = (core.node_tokens(node), stats.hits, stats.last_step, stats.created_step, stats.prior, node.priority)
    return out


def replay_both(ops, pool_tokens: int, in_flight: int, page_size: int = 1, decide_first: bool = False):
    """The same requests through VAMP's Python core and the Rust core with the mirror, in lockstep: after every
    request the same prefix hits, evicted tokens and node statistics, and the mirror equal to the Rust tree.
    `decide_first`: every eviction follows a decision's read-only walk, as at a server's shortfall.
    Returns the tokens evicted in all, and the Rust-side cache."""
    sides = []
    for policy in ("vamp", "vamp-rust"):
        cache, allocator, step = build(policy, pool_tokens, page_size=page_size)

        def call(op, fn, *args, cache=cache):
            if op == "evict" and decide_first:
                radix_eviction.eviction_candidates(cache, args[0].num_tokens, 0, 1, 4)
            return fn(*args)
        sides.append((cache, step, TreeReplay(cache, allocator, call), []))
    for kind, tokens, priority in ops:
        hits = []
        for cache, step, replay, running in sides:
            step[0] += 3  # a step each: no two leaves tie (the cores break ties by different clocks)
            if kind == "probe":
                key = RadixKey(array("q", tokens))
                hits.append(cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len)
                continue
            admission = replay.admit(tokens, len(tokens))
            hits.append(None if admission is None else admission.prefix_len)
            if admission is not None:
                running.append((admission, tokens, priority))
            if len(running) > in_flight:
                finish(replay, *running.pop(0))
        (python, _, python_replay, _), (rust, _, rust_replay, _) = sides
        assert hits[0] == hits[1], (kind, hits)
        assert python_replay.evicted_tokens == rust_replay.evicted_tokens
        assert node_statistics(python.tree_core) == node_statistics(rust.tree_core)
        check_mirror(rust.tree_core)
        # what the planner reads before a shortfall: the candidates in eviction order and the price (Eq. 2)
        assert (radix_eviction.eviction_candidates(python, 300, 0, 1, 4)
                == radix_eviction.eviction_candidates(rust, 300, 0, 1, 4))
        assert radix_eviction.estimate_eviction(python, 300) == radix_eviction.estimate_eviction(rust, 300)
    for cache, _, replay, running in sides:
        for admission, tokens, priority in running:
            finish(replay, admission, tokens, priority)
    check_mirror(sides[1][0].tree_core)
    return sides[0][2].evicted_tokens, sides[1][0]


def finish(replay: TreeReplay, admission, tokens: list[int], priority: int) -> None:
    """`TreeReplay.finish` with the request's priority (InsertParams.priority, SGLang's `priority` order)."""
    if priority:
        core = replay.cache.tree_core
        key = RadixKey(array("q", tokens))
        value = __import__("torch").cat([admission.prefix, admission.new])
        with core.written_by(admission.prefix_len / len(admission.key)):
            result = replay.cache.insert(InsertParams(key=key, value=value, prev_prefix_len=admission.prefix_len,
                                                      priority=priority))
        present = result.prefix_len - admission.prefix_len
        if present > 0:
            replay.allocator.free(admission.new[:present])
        replay.cache.unlock(admission.lock)
    else:
        replay.finish(admission, tokens)


@pytest.mark.parametrize("seed,in_flight", [(0, 0), (1, 3), (2, 6)])
def test_the_rust_core_evicts_as_the_python_core_does(seed, in_flight):
    evicted_tokens, cache = replay_both(workload(seed, 400), 1024, in_flight)
    assert evicted_tokens > 2000, "the pool hardly fell short: little was compared"
    assert cache.tree_core.vamp_ledger.hit_tokens > 0


@pytest.mark.parametrize("seed,in_flight", [(5, 0), (6, 4)])
def test_pages_of_four_tokens(seed, in_flight):
    """SGLang's paged tree (`--page-size 4`): matches, splits and inserts on page boundaries, the mirror's child
    keys a page wide. Requests are whole pages, as the scheduler inserts them (it caches whole pages only)."""
    page = 4

    def whole_pages(tokens):  # cut to whole pages, or padded to one
        return (tokens + [0] * page)[:max(page, len(tokens) // page * page)]

    ops = [(kind, whole_pages(tokens), priority) for kind, tokens, priority in workload(seed, 300)]
    evicted_tokens, cache = replay_both(ops, 1024, in_flight, page_size=page)
    assert evicted_tokens > 2000, "the pool hardly fell short: little was compared"
    assert cache.tree_core.page_size == page
    assert all(node.tokens % page == 0 for node in cache.tree_core.device_nodes())


def test_on_bench_tree_the_rust_core_keeps_the_python_cores_hits():
    from eval.bench_tree import make_trace

    evicted_tokens, _ = replay_both([("turn", tokens, 0) for tokens in make_trace(300, 8, seed=3)], 8192, 0)
    assert evicted_tokens > 0


def fresh_priority(core, node, now: int) -> tuple:
    """The tree's key of `node` priced afresh at step `now` (Eq. 1 extended); on the mirror, ending with the node id
    its ties break by (LeafOrder's `ties_by_id`)."""
    stats, shares = node.vamp_stats, core.vamp_shares
    key = (1, node.priority, *core.vamp_order.priority(stats, now, shares.prior(stats.prior),
                                                        shares.gap_steps(stats.prior)))
    return (*key, node.id) if core.vamp_leaf_order.ties_by_id else key


def test_requests_in_one_step_leave_no_stale_priority():
    """Many requests per scheduler step, as a server batches them: a node touched or admitted within the step
    its priority was memoised in must be priced afresh (every leaf's memoised priority equals Eq. 1's now)."""
    cache, allocator, step = build("vamp-rust", 1024)
    replay, core = TreeReplay(cache, allocator), cache.tree_core
    for i, (kind, tokens, _) in enumerate(workload(4, 300)):
        step[0] += 1 if i % 8 == 0 else 0
        admission = replay.admit(tokens, len(tokens))
        if admission is not None:
            replay.finish(admission, tokens)
        priced = core.priced_now()
        for leaf in core.evictable_device_leaves:
            assert priced(leaf) == fresh_priority(core, leaf, step[0]), (i, leaf.id)
    assert replay.evicted_tokens > 0


@pytest.mark.parametrize("policy", ["vamp", "vamp-rust"])
def test_a_touch_within_the_step_drops_the_memoised_priority(policy):
    """Every node priced (memoised) at a step, then the same step inserts over them: the insert's touch, a split's
    copy and a raised request priority must each drop the touched nodes' memo entries, or the eviction that follows
    in the step reads stale keys. The published priors must not move meanwhile (that alone clears the memo)."""
    cache, allocator, step = build(policy, 1 << 14)
    replay, core = TreeReplay(cache, allocator), cache.tree_core
    histories = [[i] * 40 + list(range(100 + i, 140 + i)) for i in range(8)]
    for i, tokens in enumerate(histories * 3):  # the shares settle: a few more writes do not move them
        step[0] += 1
        replay.finish(replay.admit(tokens, len(tokens)), tokens)
    step[0] += 50
    # admitted now, finished steps later (as requests decode): their inserts touch nodes last used at admission;
    # the second of two requests that branch inside one node splits it at its insert
    turns = [histories[0] + [900] * 8, histories[1][:20] + [950] * 8, histories[1][:30] + [960] * 8,
             histories[2] + [970] * 8, histories[3] + [7] * 6 + [2, 2]]
    admissions = [replay.admit(tokens, len(tokens)) for tokens in turns]
    earlier = histories[3] + [7] * 6 + [1, 1]  # in flight beside the last turn, finished first: the last one's
    replay.finish(replay.admit(earlier, len(earlier)), earlier)  # insert splits the node this one leaves
    step[0] += 10
    priced, shares = core.priced_now(), core.vamp_shares
    version = shares.refresh(core.vamp_ledger.hit_rate)
    for node in core.device_nodes():
        priced(node)
    for i, (admission, tokens) in enumerate(zip(admissions, turns)):
        finish(replay, admission, tokens, 2 if i == 3 else 0)  # one raises its path's request priority
    assert shares.refresh(core.vamp_ledger.hit_rate) == version, "the priors moved: the memo was cleared anyway"
    priced = core.priced_now()
    for node in core.device_nodes():
        assert priced(node) == fresh_priority(core, node, step[0]), node.id


@pytest.mark.parametrize("policy", ["vamp", "vamp-rust"])
def test_a_priority_raised_while_a_walk_is_open(policy):
    """A planner walk paused at a step; an insert ends in an unlocked leaf (its touch re-files the leaf into the
    open walk and prices it) and only then SGLang raises the leaf's request priority. The memo and the open walk
    must both see the raise (an adversarial review: the memo kept the old priority on both cores)."""
    cache, allocator, step = build(policy, 1 << 14)
    replay, core = TreeReplay(cache, allocator), cache.tree_core
    histories = [[i] * 40 + list(range(100 + i, 140 + i)) for i in range(8)]
    for tokens in histories * 3:
        step[0] += 1
        replay.finish(replay.admit(tokens, len(tokens)), tokens)
    step[0] += 50
    turn = histories[2] + [970] * 8  # twice, in flight together: the second insert ends in the leaf the first wrote
    admissions = [replay.admit(turn, len(turn)) for _ in range(2)]
    finish(replay, admissions[0], turn, 0)
    step[0] += 1
    shares = core.vamp_shares
    version = shares.refresh(core.vamp_ledger.hit_rate)
    walk = core.vamp_ordered_walk(lambda n: n in core.evictable_device_leaves)
    taken = {next(walk).id}
    finish(replay, admissions[1], turn, 2)
    assert shares.refresh(core.vamp_ledger.hit_rate) == version, "the priors moved: the memo was cleared anyway"

    priced = core.priced_now()
    assert all(priced(node) == fresh_priority(core, node, step[0]) for node in core.device_nodes())
    rest = [node for node in core.evictable_device_leaves if node.id not in taken]
    assert [n.id for n in walk] == [n.id for n in sorted(rest, key=lambda n: (fresh_priority(core, n, step[0]), n))]


def test_what_the_mirror_cannot_follow_is_refused_before_the_tree_is_built():
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1,
                             tree_components=(ComponentType.FULL,), eviction_policy=radix_backend.NAME,
                             enable_session_radix_cache=True)
    with pytest.raises(ValueError, match="--enable-session-radix-cache"):
        VampRustTreeCore(params, CostOrder(Coefficients()))
    hybrid = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1,
                             tree_components=(ComponentType.FULL, ComponentType.MAMBA),
                             eviction_policy=radix_backend.NAME)
    with pytest.raises(ValueError, match="hybrid"):
        VampRustTreeCore(hybrid, CostOrder(Coefficients()))


def test_compaction_moves_the_rust_cores_rows_and_their_bytes():
    """Restoring experts shrinks the pool from its tail (compaction.py): the rows of unlocked nodes above the new
    size move to free rows below it, bytes and indices both, through the Rust core's own values."""
    import torch

    from vamp_sglang.integration.memory import compaction
    from vamp_sglang.integration.memory.kv_pool import sglang_buffers

    cache, allocator, step = build("vamp-rust", 64)
    replay, kv = TreeReplay(cache, allocator), allocator.get_kvcache()
    held_low = allocator.alloc(32)  # the next allocations land above row 32
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [7, 8, 9, 10]]
    for tokens in prompts:
        step[0] += 1
        admission = replay.admit(tokens, len(tokens))
        replay.finish(admission, tokens)
    locked = cache.lock(cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompts[2])))).last_device_node)
    allocator.free(held_low)
    rows_before = {tuple(t): cache.path_device_indices(cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", t)))).last_device_node) for t in prompts}
    for buffer in sglang_buffers(kv):
        buffer.copy_(torch.arange(buffer.shape[0], dtype=buffer.dtype).view(-1, 1, 1).expand_as(buffer))
    moved = compaction.compact_tail(cache, allocator, kv, keep_tokens=32)
    assert moved == 8  # the unlocked nodes' rows: [1, 2, 3], [4, 5, 6], [9, 9]; [7, 8, 9, 10] is locked
    for tokens in prompts:
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        rows = cache.path_device_indices(match.last_device_node)
        assert match.device_prefix_len == len(tokens)
        for buffer in sglang_buffers(kv):  # each token's bytes moved with it
            assert torch.equal(buffer[rows, 0, 0], rows_before[tuple(tokens)].to(buffer.dtype))
        assert bool((rows <= 32).all()) == (tokens != prompts[2])
    cache.unlock(locked)
    check_mirror(cache.tree_core)


def test_an_eagle_tree_matched_by_token_keys_is_followed():
    """Found by a review: speculative decoding (EAGLE, EAGLE3, NEXTN) makes the Rust core key its tree by token
    bigrams. The scheduler inserts bigram keys (`checkpoint_into_tree`) but matches by plain token keys
    (`_req_radix_key`), so a match that splits a node reached the mirror in the other form: it filed the prefix as
    a new sibling, and counted its tokens twice, so the next eviction ended VAMP's order (it used to name the
    prefix, an inner node, and panic the Rust core). Random admissions as the scheduler keys them, pages 1 and 4."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from eval.cachesim.tree import cache_spec

    for page in (1, 4):
        kv = MHATokenToKVPool(size=512, page_size=page, dtype=torch.float16, head_num=1, head_dim=1, layer_num=1,
                              device="cpu", enable_memory_saver=False)
        allocator = PagedTokenToKVPoolAllocator(512, page, torch.float16, "cpu", kv, need_sort=False)
        backend, eviction, cache_class = cache_spec("vamp-rust")
        cache = cache_class(CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=page,
            tree_components=(ComponentType.FULL,), eviction_policy=eviction, tree_core_backend=backend, is_eagle=True))
        core, step, rng, evicted = cache.tree_core, [0], random.Random(page), 0
        assert core.is_eagle and isinstance(core, VampRustTreeCore)
        radix_backend.bind_step_source(cache, lambda step=step: step[0])
        histories = [[1000 * s + i for i in range(rng.randint(3, 12))] for s in range(6)]
        for _ in range(150):
            step[0] += 1
            history = rng.choice(histories)
            prompt = history[:rng.randint(1, len(history))] + [rng.randrange(500) for _ in range(rng.randint(0, 3))]
            match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt))))  # the scheduler's form
            lock = cache.lock(match.last_device_node)
            tokens = prompt + [rng.randrange(500) for _ in range(rng.randint(page, 3 * page))]
            key = RadixKey(array("q", tokens), is_bigram=True)  # as checkpoint_into_tree keys an insert
            whole = len(key) // page * page
            new_rows = whole - match.device_prefix_len
            if new_rows > allocator.available_size():
                evicted += cache.evict(EvictParams(num_tokens=new_rows - allocator.available_size() + 4 * page)
                                       ).num_tokens_evicted
            if new_rows > 0:
                prefix = cache.path_device_indices(match.last_device_node)[:match.device_prefix_len]
                new = allocator.alloc(new_rows)
                key.limit = whole + 1  # whole pages of bigrams: one raw token more
                result = cache.insert(InsertParams(key=key, value=torch.cat([prefix, new]),
                                                   prev_prefix_len=match.device_prefix_len))
                if result.prefix_len > match.device_prefix_len:
                    allocator.free(new[:result.prefix_len - match.device_prefix_len])
            cache.unlock(lock)
            history.extend(tokens[len(history):])
            assert core.vamp_lost is None, core.vamp_lost
            check_mirror(core)
        assert evicted > 0, "the pool never fell short: no eviction checked the mirror"


@pytest.mark.parametrize("policy", ["vamp", "vamp-rust"])
def test_a_declined_insert_leaves_the_path_unused(policy):
    """Page-interleaved KV sharding: an insert whose rotation base differs from the cached chain's is declined
    (`rotation_tail_declined`). SGLang's Python core then touches nothing on the path and raises no priority; the
    mirror used to touch the path and raise the node's priority (found by a review)."""
    cache, allocator, step = build(policy, 256)
    core = cache.tree_core
    step[0] = 1
    first = cache.insert(InsertParams(key=RadixKey(array("q", range(16))), value=allocator.alloc(16),
                                      rotation_base=0))
    step[0] = 5
    tokens = list(range(8)) + [99] * 8
    declined = cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=allocator.alloc(16),
                                         rotation_base=1, priority=7))
    assert declined.rotation_tail_declined and not first.rotation_tail_declined
    node = core.vamp_node(declined.last_device_node)
    assert node.vamp_stats.last_step == 1 and node.priority == 0
