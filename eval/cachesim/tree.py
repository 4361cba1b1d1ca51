"""SGLang's real radix cache at a fixed pool size, and one request through it as the scheduler runs it.

`build` makes SGLang 0.5.23's `UnifiedRadixCache` over a token pool of `pool_tokens` (CPU, one tiny
KV layer: only indices matter) with a tree core and eviction policy:

    lru, lfu, slru, priority, ...   SGLang's own policies on its default Rust tree core
    vamp                            VampUnifiedRadixCache over VampTreeCore, p_eff order (the project's code)
    opt                             SGLang's Python tree core with `oracle.OptStrategy` (farthest next use)
    "python:<policy>"               an SGLang policy on SGLang's Python core (tests compare the cores)

`TreeReplay` runs a request's cache operations: `admit` (match the prompt, lock the prefix, count
the admission, evict the shortfall, allocate the rest of the request's KV; or refuse when even the
evictable tree does not make room, as SGLang's admission check does) and `finish` (insert the
request's prompt and answer, free what another request inserted meanwhile, unlock). `call` wraps
every SGLang call (eval.bench_tree times them through it).

With `sessions` (SGLang's `--enable-session-radix-cache`, its radix-native sessions) `finish` also
tags the request's KV with its session as the scheduler's `cache_finished_req` does
(`session_refs.register_session_ref`), and releases the session after its last turn as a client's
`/close_session` does (`release_radix_session`); SGLang then evicts KV no open session holds first.
The request SGLang's tracker reads is a namespace of the four fields it uses: there is no scheduler here.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.unified_allocator_fixtures import setup_allocator_context

from vamp_sglang.integration.cache import radix_backend, radix_tree


def prepare() -> None:
    """Once per process, before `build`: SGLang's runtime context for a bare cache, our registrations."""
    torch.set_num_threads(1)
    setup_allocator_context()
    radix_backend.install()


def _direct(op: str, fn: Callable, *args: Any) -> Any:
    return fn(*args)


def cache_spec(policy: str) -> tuple[str, str, type]:
    """(tree core backend, SGLang eviction policy, cache class) for a simulator policy name."""
    if policy == "vamp":
        return radix_backend.NAME, radix_backend.NAME, radix_tree.VampUnifiedRadixCache
    if policy == "vamp+lru":  # our tree and statistics, SGLang's LRU order (bench_tree)
        return radix_backend.NAME, "lru", radix_tree.VampUnifiedRadixCache
    if policy == "vamp-rust":  # VAMP's order on SGLang's Rust core (integration/cache/radix_rust.py)
        return radix_backend.RUST_NAME, radix_backend.NAME, radix_tree.VampUnifiedRadixCache
    if policy == "opt":
        return "python", "lru", UnifiedRadixCache  # the strategy is replaced by OptStrategy
    if policy.startswith("python:"):
        return "python", policy.split(":", 1)[1], UnifiedRadixCache
    return "rust", policy, UnifiedRadixCache


def build(policy: str, pool_tokens: int, sessions: bool = False,
          page_size: int = 1) -> tuple[UnifiedRadixCache, TokenToKVPoolAllocator, list[int]]:
    """The cache, its allocator and the step counter VAMP's ages read (a one-element list). `sessions`:
    SGLang's radix-native sessions on (its Python tree core; the Rust core has none). `page_size` above 1:
    SGLang's paged allocator, and the tree matches and inserts whole pages (requests' lengths must be whole pages)."""
    backend, eviction, cache_class = cache_spec(policy)
    kv = MHATokenToKVPool(size=pool_tokens, page_size=page_size, dtype=torch.float16, head_num=1, head_dim=1,
                          layer_num=1, device="cpu", enable_memory_saver=False)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(pool_tokens, torch.float16, "cpu", kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(pool_tokens, page_size, torch.float16, "cpu", kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=page_size, tree_components=(ComponentType.FULL,), eviction_policy=eviction,
                             tree_core_backend="python" if sessions and backend == "rust" else backend,
                             enable_session_radix_cache=sessions)
    cache = cache_class(params)
    step = [0]
    if isinstance(cache.tree_core, radix_tree.VampStatistics):
        radix_backend.bind_step_source(cache, lambda: step[0])
    return cache, allocator, step


def tag_session(cache: UnifiedRadixCache, session: str, leaf_id: int) -> None:
    """Tag the KV on the path to `leaf_id` with `session`, as the scheduler's `cache_finished_req` does for a
    finished request of a radix-native session (opening the session first, as request creation does)."""
    req = SimpleNamespace(session=None, session_id=session, finished_reason=None,
                          session_generation=cache.ensure_session_generation(session))
    cache.session_refs.register_session_ref(req, leaf=leaf_id)


@dataclass
class Admission:
    key: RadixKey  # the prompt
    prefix_len: int
    prefix: torch.Tensor  # KV indices of the matched prefix
    lock: Any
    new: torch.Tensor | None = None  # KV indices allocated for the rest of prompt and answer


class TreeReplay:
    def __init__(self, cache: UnifiedRadixCache, allocator: TokenToKVPoolAllocator,
                 call: Callable[..., Any] = _direct) -> None:
        self.cache, self.allocator, self.call = cache, allocator, call
        core = cache.tree_core
        self.vamp = core if isinstance(core, radix_tree.VampStatistics) else None
        self.evicted_tokens = 0

    def admit(self, prompt: list[int], total_tokens: int, count: bool = True) -> Admission | None:
        """Admit a request whose KV will hold `total_tokens` (prompt and answer); None: it does not
        fit even after evicting every unlocked node (nothing was evicted or counted then)."""
        cache, allocator = self.cache, self.allocator
        key = RadixKey(array("q", prompt))
        match = self.call("match", cache.match_prefix, MatchPrefixParams(key=key))
        prefix_len = match.device_prefix_len
        prefix = cache.path_device_indices(match.last_device_node)[:prefix_len]
        lock = cache.lock(match.last_device_node)
        need = total_tokens - prefix_len
        if need > allocator.available_size() + cache.evictable_size():
            cache.unlock(lock)
            return None
        if self.vamp is not None and count:
            self.call("admit", self.vamp.record_admission, match.last_device_node, prefix_len, len(prompt), True)
        if need > allocator.available_size():
            result = self.call("evict", cache.evict, EvictParams(num_tokens=need - allocator.available_size()))
            self.evicted_tokens += result.num_tokens_evicted
        admission = Admission(key, prefix_len, prefix, lock)
        admission.new = allocator.alloc(need) if need else prefix[:0]
        return admission

    def finish(self, admission: Admission, tokens: list[int], session: str | None = None,
               close: bool = False) -> None:
        """The request is done: its prompt and answer (`tokens`) enter the tree; unlock its prefix. With
        the cache's sessions on, `session` tags what it left in the tree, and `close` ends the session."""
        result = None
        if admission.new is not None:
            key = RadixKey(array("q", tokens))
            params = InsertParams(key=key, value=torch.cat([admission.prefix, admission.new]),
                                  prev_prefix_len=admission.prefix_len)
            if self.vamp is not None:  # as VampUnifiedRadixCache.checkpoint_into_tree does
                with self.vamp.written_by(admission.prefix_len / len(admission.key)):
                    result = self.call("insert", self.cache.insert, params)
            else:
                result = self.call("insert", self.cache.insert, params)
            present = result.prefix_len - admission.prefix_len  # another request inserted these meanwhile
            if present > 0:
                self.allocator.free(admission.new[:present])
        self.cache.unlock(admission.lock)
        if session is not None and self.cache.enable_session_radix_cache:
            if result is not None:
                tag_session(self.cache, session, result.last_device_node)
            if close:
                self.cache.release_radix_session(session)
