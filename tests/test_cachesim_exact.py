"""eval.cachesim on small hand-built traces whose answers are worked out by hand: the optima's hit counts, and
which leaf each policy evicts, in order.

The property tests (tests/test_cachesim.py) bound the policies by a brute-force optimum; they cannot see a
policy that evicts the wrong leaf (any whole-leaf policy is one of the sequences the brute force tries) nor a
bound that is too high. Here every answer is exact. A trace is a list of prompts, each a string of blocks
("SA": block S, then block A), two tokens a block unless named in `SIZES`, no answers; one request at a time,
each a step on VAMP's clock. Eviction sequences are read off the allocator: each leaf an eviction frees is
named by its blocks, in the order SGLang freed them, one list per eviction call.
"""

import pytest

from eval.cachesim import sim
from eval.cachesim.oracle import FutureTrie
from eval.cachesim.tree import TreeReplay, prepare
from eval.cachesim.workload import SimRequest

SIZES = {"L": 4, "U": 1}  # block sizes other than two tokens


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    prepare()


def block_tokens(name):
    return [1000 * (ord(name) - ord("A") + 1) + k for k in range(SIZES.get(name, 2))]


def trace(prompts):
    return [SimRequest(i, f"r{i}", 0, [t for b in p for t in block_tokens(b)], [])
            for i, p in enumerate(prompts)]


class EvictionLog:
    """Stands in for sim.TreeReplay: the same replay; each eviction's freed leaves named by their blocks."""

    def __init__(self):
        self.block_at, self.evictions = {}, []  # KV index -> block name

    def __call__(self, cache, allocator):
        def call(op, fn, *args):
            if op == "insert":
                params = args[0]
                self.block_at.update((i, chr(t // 1000 - 1 + ord("A")))
                                     for i, t in zip(params.value.tolist(), params.key.token_ids))
            if op != "evict":
                return fn(*args)
            freed, free = [], allocator.free
            allocator.free = lambda indices: (freed.append(indices.tolist()), free(indices))[1]
            try:
                return fn(*args)
            finally:
                del allocator.free
                names = ["".join(dict.fromkeys(self.block_at[i] for i in leaf)) for leaf in freed]
                self.evictions.append(names)

        return TreeReplay(cache, allocator, call)


def run(prompts, policy, pool, monkeypatch):
    """(total token hits, eviction calls with the leaves each freed in order; for bound: evicted tokens)."""
    requests = trace(prompts)
    trie = FutureTrie(requests)
    log = EvictionLog()
    monkeypatch.setattr(sim, "TreeReplay", log)
    result = sim.simulate(requests, trie, policy, pool)
    hits = sum(trie.unbounded_hits) - result["reprefill_tokens"]
    return hits, (result["evictions"] if policy == "bound" else log.evictions)


# A pool of two 2-token prompts, three prompts in turn: A B C A B C A B.
CYCLE = ["A", "B", "C", "A", "B", "C", "A", "B"]


def test_belady_on_a_cycle_of_three_prompts_in_a_pool_of_two(monkeypatch):
    """opt: at C (t2) A comes back at t3, B at t4: B goes; at B (t4) C is due at t5, A at t6: A goes; at A
    (t6) C never comes back: C goes. Hits A@3, C@5, B@7: 6 tokens. Tokens of one prompt share their next
    use, so the token-granular bound evicts the same and hits the same 6 (6 tokens evicted)."""
    assert run(CYCLE, "opt", 4, monkeypatch) == (6, [["B"], ["A"], ["C"]])
    assert run(CYCLE, "bound", 4, monkeypatch) == (6, 6)


def test_lru_and_vamp_on_the_cycle(monkeypatch):
    """LRU evicts the prompt needed next every time (no hits). VAMP: at C nothing was ever hit (every prior
    0, p_eff 0) and ties go to the newest node: B goes and A stays, so A hits at t3. From then on A, hit,
    is kept (expected back, and hit KV goes after never-hit KV), and each miss evicts the other, never-hit
    prompt: C at B (t4), B at C (t5), C at B (t7). A hits at t3 and t6: 4 tokens."""
    assert run(CYCLE, "lru", 4, monkeypatch) == (0, [["A"], ["B"], ["C"], ["A"], ["B"], ["C"]])
    assert run(CYCLE, "vamp", 4, monkeypatch) == (4, [["B"], ["C"], ["B"], ["C"]])


def test_with_nothing_reused_lru_evicts_the_oldest_and_vamp_the_newest(monkeypatch):
    """Four prompts, none reused, a pool of two: LRU frees A for C and B for D; VAMP (all p_eff 0, ties to
    the newest) B for C and C for D: the oldest KV stays, a stable subset where LRU would cycle."""
    prompts = ["A", "B", "C", "D"]
    assert run(prompts, "lru", 4, monkeypatch) == (0, [["A"], ["B"]])
    assert run(prompts, "vamp", 4, monkeypatch) == (0, [["B"], ["C"]])


def test_belady_under_a_shared_prefix_evicts_leaves_only(monkeypatch):
    """S is every prompt's first block; a pool of S and two branches (6 tokens). opt: at SC (t2) A is due
    at t3, B at t4: B goes (not S, an inner node); at SB (t4) A and C never come back, the least recently
    used goes: C. Hits: S at t1 and t2, SA at t3, S at t4: 10 tokens; the bound cannot do better (it evicts
    B's tokens at t2, then 2 of A's and C's). LRU: A (t2), B (t3), C (t4), each the branch needed next but
    one: S hits 4 times."""
    prompts = ["SA", "SB", "SC", "SA", "SB"]
    assert run(prompts, "opt", 6, monkeypatch) == (10, [["B"], ["C"]])
    assert run(prompts, "bound", 6, monkeypatch) == (10, 4)
    assert run(prompts, "lru", 6, monkeypatch) == (8, [["A"], ["B"], ["C"]])


def test_the_bound_keeps_part_of_a_node_where_opt_must_drop_all_of_it(monkeypatch):
    """A pool of 3 tokens, prompts A B A. For B the bound evicts one token, A's last, and at A (t2) hits
    its first token, then evicts B's last token (never used again) for the other: 1 hit, 2 tokens evicted.
    opt can only drop A whole for B, then B for A: no hit."""
    assert run(["A", "B", "A"], "bound", 3, monkeypatch) == (1, 2)
    assert run(["A", "B", "A"], "opt", 3, monkeypatch) == (0, [["A"], ["B"]])


def test_the_bound_evicts_the_node_whose_next_use_is_farthest_not_the_oldest_write(monkeypatch):
    """A B C B in a pool of two prompts: A is never read again, B at t3: A goes for C, B hits 2 tokens."""
    for policy in ("bound", "opt"):
        assert run(["A", "B", "C", "B"], policy, 4, monkeypatch)[0] == 2, policy


def test_a_request_that_exactly_fits_what_is_not_locked_is_served(monkeypatch):
    """L is 4 tokens, the whole pool. A then AB (4 tokens: A hit, locked, and B exactly fills the rest), AB
    again: hits 2 + 4. Then L alone: it needs the whole pool (everything evicted), and L again hits 4."""
    prompts = ["A", "AB", "AB", "L", "L"]
    assert run(prompts, "bound", 4, monkeypatch) == (10, 4)
    for policy in ("opt", "lru", "vamp"):
        assert run(prompts, policy, 4, monkeypatch) == (10, [["B", "A"]]), policy


def test_a_pool_one_token_larger_is_not_the_pool_asked_for(monkeypatch):
    """U is one token. A B fill a pool of 4; U then needs one: LRU frees A (a whole node), VAMP B (the
    newest). With one more token in the pool nothing would go."""
    assert run(["A", "B", "U", "A"], "lru", 4, monkeypatch) == (0, [["A"], ["B"]])
    assert run(["A", "B", "U", "A"], "vamp", 4, monkeypatch)[1][0] == ["B"]
    assert run(["A", "B", "U"], "bound", 4, monkeypatch) == (0, 1)
