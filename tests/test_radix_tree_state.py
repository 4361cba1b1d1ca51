"""Our tree core inside SGLang's real UnifiedRadixCache, driven by random operation sequences.

The cache, allocator and KV pool are SGLang's own CPU objects (no fakes). After every step the
machine checks SGLang's accounting (its own `sanity_check`, evictable + protected sizes, no KV
slot both free and cached, free + cached == pool), that locked paths survive eviction, that the
read-only walk predicted each eviction exactly, and that hit counts never grow down a path.
"""

from array import array

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.test.unified_allocator_fixtures import setup_allocator_context

from vamp_sglang.integration.cache import radix_backend, radix_eviction, radix_tree

POOL_TOKENS = 64
FULL = ComponentType.FULL


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    setup_allocator_context()
    radix_backend.install()


def build_cache(page_size: int, sessions: bool = False, policy: str = "vamp"):
    kv = MHATokenToKVPool(size=POOL_TOKENS, page_size=page_size, dtype=torch.float16, head_num=1, head_dim=4,
                          layer_num=1, device="cpu", enable_memory_saver=False)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(POOL_TOKENS, torch.float16, "cpu", kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(POOL_TOKENS, page_size, torch.float16, "cpu", kv, need_sort=False)
    req_pool = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                             page_size=page_size, tree_components=(FULL,), eviction_policy=policy,
                             enable_session_radix_cache=sessions, tree_core_backend=radix_backend.NAME)
    return radix_tree.VampUnifiedRadixCache(params), allocator


def key_of(tokens: list[int]) -> RadixKey:
    return RadixKey(array("q", tokens))


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    sessions = False
    policy = "vamp"

    def __init__(self) -> None:
        super().__init__()
        self.cache, self.allocator = build_cache(self.page_size, self.sessions, self.policy)
        self.core = radix_tree.tree_core_of(self.cache)
        self.step = 0
        radix_backend.bind_step_source(self.cache, lambda: self.step)
        self.locks: list[tuple[object, int]] = []

    def sequences(self):
        pages = st.lists(st.lists(st.integers(0, 2), min_size=self.page_size, max_size=self.page_size),
                         min_size=1, max_size=16 // self.page_size)
        return pages.map(lambda ps: [t for p in ps for t in p])

    def _match(self, tokens):
        return self.cache.match_prefix(MatchPrefixParams(key=key_of(tokens)))

    def _alloc(self, need: int):
        shortfall = need - self.allocator.available_size()
        if shortfall > 0:
            self.cache.evict(EvictParams(num_tokens=shortfall))
        return self.allocator.alloc(need) if need else torch.empty(0, dtype=torch.int64)

    # --- operations, as SGLang's scheduler performs them ------------------------------------------
    @rule(data=st.data(), admitted=st.booleans())
    def run_request(self, data, admitted):
        """Match, lock, allocate the extension, (count the admission,) insert, unlock."""
        tokens = data.draw(self.sequences())
        match = self._match(tokens)
        prefix_len = match.device_prefix_len
        prefix = self.cache.path_device_indices(match.last_device_node)[:prefix_len]
        lock = self.cache.lock(match.last_device_node)
        new = self._alloc(len(tokens) - prefix_len)
        if new is not None:
            if admitted:
                self._admit(match.last_device_node, prefix_len, len(tokens))
            self.cache.insert(InsertParams(key=key_of(tokens), value=torch.cat([prefix, new]),
                                           prev_prefix_len=prefix_len))
        self.cache.unlock(lock)

    def _admit(self, node_id: int, prefix_len: int, requested: int) -> None:
        path, node = [], self.core.node_by_id(node_id)
        while node is not self.core.root_node:
            path.append((node, node.vamp_stats.hits))
            node = node.parent
        before = self.core.vamp_ledger.hit_tokens
        self.core.record_admission(node_id, prefix_len, requested, first=True)
        assert all(n.vamp_stats.hits == h + 1 and n.vamp_stats.last_step == self.step for n, h in path)
        assert self.core.vamp_ledger.hit_tokens == before + prefix_len

    @rule(data=st.data())
    def insert_fresh_copy(self, data):
        """A request that recomputed a cached prefix: the tree frees the duplicate slots itself."""
        tokens = data.draw(self.sequences())
        value = self._alloc(len(tokens))
        if value is not None:
            self.cache.insert(InsertParams(key=key_of(tokens), value=value))

    @rule(data=st.data())
    def lock_prefix(self, data):
        match = self._match(data.draw(self.sequences()))
        self.locks.append((self.cache.lock(match.last_device_node), match.last_device_node))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        lock, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(lock)

    @rule(steps=st.integers(0, 3000))
    def advance(self, steps):
        self.step += steps

    @rule(n_tokens=st.integers(0, POOL_TOKENS))
    def evict(self, n_tokens):
        sizes = (self.cache.evictable_size(), self.cache.protected_size())
        leaves = set(self.core.evictable_device_leaves)
        plan = radix_eviction.eviction_plan(self.cache, n_tokens)
        assert (self.cache.evictable_size(), self.cache.protected_size()) == sizes  # read-only
        assert set(self.core.evictable_device_leaves) == leaves
        assert radix_eviction.estimate_eviction(self.cache, n_tokens) == (plan.tokens, plan.cost_s)
        before = {n.id for n in self.core.device_nodes()}
        result = self.cache.evict(EvictParams(num_tokens=n_tokens))
        gone = before - {n.id for n in self.core.device_nodes()}
        assert gone == {n.id for n in plan.nodes}
        assert result.num_tokens_evicted == plan.tokens

    # --- invariants --------------------------------------------------------------------------------
    @invariant()
    def sglang_tree_is_consistent(self):
        self.core.sanity_check([], [])

    @invariant()
    def sizes_add_up_and_no_kv_slot_leaks(self):
        nodes = self.core.device_nodes()
        values = [n.component_data[FULL].value for n in nodes]
        cached = sum(len(v) for v in values)
        protected = sum(len(n.component_data[FULL].value) for n in nodes if n.component_data[FULL].lock_ref > 0)
        assert (self.cache.evictable_size(), self.cache.protected_size()) == (cached - protected, protected)
        slots = torch.cat(values).tolist() if values else []
        assert len(set(slots)) == len(slots), "a KV slot is held by two nodes"
        free_pages = set(self.allocator.get_all_free_pages().tolist())
        assert not {s // self.page_size for s in slots} & free_pages, "a cached KV slot is also free"
        assert self.allocator.available_size() + cached == POOL_TOKENS

    @invariant()
    def locked_paths_stay_on_device(self):
        for _, node_id in self.locks:
            node = self.core.node_by_id(node_id)
            while node is not self.core.root_node:
                assert node.component_data[FULL].value is not None and node.component_data[FULL].lock_ref > 0
                node = node.parent

    @invariant()
    def hits_never_grow_down_a_path(self):
        for node in self.core.device_nodes():
            if node.parent is not self.core.root_node:
                assert node.parent.vamp_stats.hits >= node.vamp_stats.hits

    def teardown(self) -> None:
        for lock, _ in self.locks:
            self.cache.unlock(lock)


SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class PagedRadixMachine(RadixMachine):
    page_size = 4


class SessionRadixMachine(RadixMachine):
    sessions = True


class LruOrderRadixMachine(RadixMachine):
    """Our statistics under SGLang's stock LRU order: the walk must still predict evictions."""

    policy = "lru"


TestRadixTokenPages = RadixMachine.TestCase
TestRadixTokenPages.settings = SETTINGS
TestRadixPaged = PagedRadixMachine.TestCase
TestRadixPaged.settings = SETTINGS
TestRadixSessions = SessionRadixMachine.TestCase
TestRadixSessions.settings = SETTINGS
TestRadixLruOrder = LruOrderRadixMachine.TestCase
TestRadixLruOrder.settings = SETTINGS
