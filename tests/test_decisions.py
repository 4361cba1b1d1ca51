"""The decision path on SGLang's own objects, in one process (issue 9: a shortfall never takes the
server down, and every decision is priced the way SGLang carries it out).

A real `MHATokenToKVPool` over growable buffers, a real allocator, our tree inside SGLang's real
`UnifiedRadixCache`, real paged experts (`ExpertMemory`) and a real one-rank controller. The
scheduler around them is a plain namespace holding exactly the fields the decision maker reads
(the step counter, the running batch); tests/test_server_faults.py runs the real scheduler.
"""

import time
from array import array
from types import SimpleNamespace

import pytest
from sglang.srt import runtime_context
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.prefill_budget import PrefillBudget
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from tests.test_integration_memory import fused_shared_experts, sglang_moe, vamp  # noqa: F401 (fixtures)
from vamp_sglang.config import VampConfig
from vamp_sglang.controller import RankController
from vamp_sglang.controller.rounds import ROUND_BACKOFF_STEPS, RankRounds
from vamp_sglang.faults import Faults
from vamp_sglang.integration.cache import radix_backend, radix_eviction, radix_tree
from vamp_sglang.integration.decisions import decision_hooks, plan_inputs, restore_trigger
from vamp_sglang.integration.decisions.shortfall import DecisionMaker
from vamp_sglang.integration.runtime import VampRuntime

EVICT = BaseTokenToKVPoolAllocator.evict_to_free_tokens  # SGLang's own (no hooks in this process)


@pytest.fixture(scope="module", autouse=True)
def allocator_context(sglang_moe):  # noqa: F811  (its one-process parallel context serves the tree too)
    radix_backend.install()


def request(budget, output=0, prompt=10, committed=None, protected=0):
    kv = SimpleNamespace(kv_committed_len=prompt + output if committed is None else committed,
                         cache_protected_len=protected)
    return SimpleNamespace(rid=f"r{budget}-{output}", sampling_params=SimpleNamespace(max_new_tokens=budget + output),
                           output_ids=[0] * output, origin_input_ids=[0] * prompt, kv=kv,
                           owned_kv_len=lambda: kv.kv_committed_len)


def tree_and_scheduler(alloc, page_size):
    """Our tree over `alloc`, and the scheduler fields the decision maker reads."""
    params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(size=8, max_context_len=512,
                                                                              device="cpu", enable_memory_saver=False),
                             token_to_kv_pool_allocator=alloc, page_size=page_size,
                             tree_components=(ComponentType.FULL,), eviction_policy="vamp",
                             tree_core_backend=radix_backend.NAME)
    tree = radix_tree.VampUnifiedRadixCache(params)
    return tree, SimpleNamespace(max_total_num_tokens=alloc.size, forward_ct=0, tree_cache=tree,
                                 token_to_kv_pool_allocator=alloc, running_batch=SimpleNamespace(reqs=[]),
                                 spec_algorithm=SpeculativeAlgorithm.NONE)


def decisions_over(alloc, memory, monkeypatch):
    """Our tree over `alloc` (page size 1), a runtime holding `memory` that the hooks find, and `make`,
    which builds its DecisionMaker (faults via `make(fault_spec)`)."""
    tree, scheduler = tree_and_scheduler(alloc, page_size=1)
    runtime = VampRuntime(scheduler, VampConfig(max_offload_ratio=0.5, restore_after_steps=20), 0, False)
    radix_backend.bind_step_source(tree, lambda: scheduler.forward_ct)
    radix_tree.tree_core_of(tree).vamp_ledger = runtime.ledger
    runtime.vamp_tree = tree
    runtime.expert_memory = memory
    monkeypatch.setattr(decision_hooks, "current", lambda: runtime)

    def make(fault_spec=None):
        runtime.decision_maker = DecisionMaker(runtime, memory, RankController(0, 1, None), 2,
                                               Faults.parse(fault_spec, seed=0))
        memory.faults = runtime.decision_maker.faults
        return runtime.decision_maker

    return SimpleNamespace(alloc=alloc, memory=memory, tree=tree, scheduler=scheduler, runtime=runtime, make=make)


@pytest.fixture
def maker(vamp, monkeypatch):  # noqa: F811
    """A DecisionMaker over a real pool (page size 1), tree and expert memory."""
    pool, alloc, memory = vamp.build(1)
    ns = decisions_over(alloc, memory, monkeypatch)
    ns.pool = pool
    yield ns
    ns.tree.reset()


def cache_prompts(ns, count, tokens_each):
    """`count` distinct cached prompts of `tokens_each` tokens (evictable), one leaf each."""
    for i in range(count):
        key = RadixKey(array("q", [10_000 + i] * tokens_each))
        ns.tree.insert(InsertParams(key=key, value=ns.alloc.alloc(tokens_each)))


def offload_and_cache_the_tail(ns, groups, prompts, tokens_each):
    """Offload `groups`, then cache `prompts` prompts in the pool's last rows: a restore must move them."""
    ns.memory.offload(groups, ns.memory.tokens_for(groups))
    ns.runtime.decision_maker.inputs.refresh_view()
    held = ns.alloc.alloc(ns.alloc.available_size() - prompts * tokens_each)
    cache_prompts(ns, prompts, tokens_each)
    ns.alloc.free(held)


def go_idle_for_11_s(scheduler, monkeypatch):
    """The idle hook at the poll the server went idle, and again 11 s (of wall clock) later."""
    scheduler.is_fully_idle = lambda: True
    decision_hooks._before_on_idle(scheduler)
    clock = [time.monotonic() + 11.0]
    monkeypatch.setattr(restore_trigger.time, "monotonic", lambda: clock[0])
    decision_hooks._before_on_idle(scheduler)


def test_an_error_in_the_decision_code_falls_back_to_sglangs_eviction(maker, monkeypatch):
    """Issue 9.2: before, any exception in snapshot or planning escaped through the allocator."""
    dm = maker.make()
    cache_prompts(maker, 10, 10)
    held = maker.alloc.alloc(maker.alloc.available_size())
    assert held is not None and maker.alloc.available_size() == 0

    def broken(*args, **kwargs):
        raise ValueError("a bug in the snapshot")

    monkeypatch.setattr(radix_eviction, "eviction_candidates", broken)
    for _ in range(2):
        need = maker.alloc.available_size() + 25
        dm.on_shortfall(EVICT, maker.alloc, maker.tree, need, "prefill", None)
        assert maker.alloc.available_size() >= need  # SGLang's own eviction covered the shortfall
    assert dm.counts["errors"] == 2 and dm.stats()["decision_errors"] == 2
    assert maker.memory.offloaded_groups == 0


def _check_prefill(maker, total_tokens):
    budget = PrefillBudget(maker.alloc, maker.tree)
    return decision_hooks._around_check_prefill(
        PrefillBudget.check_prefill, budget, extend_input_len=total_tokens, total_tokens=total_tokens,
        max_new_tokens=0, input_tokens=total_tokens, swa_host_hit_length=0, chunk_limit=None)


def test_admission_never_promises_headroom_a_failed_offload_cannot_deliver(maker):
    """Issue 9.1: before, admission counted the headroom as free; a failed offload then left the
    prefill allocation uncovered and SGLang's "Out of memory" killed the scheduler."""
    dm = maker.make("remap:1")
    cache_prompts(maker, 4, 20)
    free_and_evictable = maker.alloc.available_size() + maker.tree.evictable_size()
    headroom = dm.admission_headroom_tokens()
    assert headroom > 60
    size = maker.alloc.size
    assert _check_prefill(maker, free_and_evictable + 50) == (False, None)  # waits, untouched
    assert maker.alloc.size == size and maker.memory.offloaded_groups == 0
    assert dm.counts["admission_refusals"] == 1 and dm.counts["offload_failures"] == 1
    assert dm.faults.fired["remap"] == 1
    assert dm.admission_headroom_tokens() == 0  # backs off: no headroom offered for a while
    assert _check_prefill(maker, free_and_evictable - 1)[0]  # what really fits is still admitted
    maker.scheduler.forward_ct += plan_inputs.OFFLOAD_RETRY_STEPS
    assert dm.admission_headroom_tokens() == headroom


def test_admission_that_needs_headroom_offloads_before_the_request_is_admitted(maker):
    dm = maker.make()
    cache_prompts(maker, 4, 20)
    free_and_evictable = maker.alloc.available_size() + maker.tree.evictable_size()
    size = maker.alloc.size
    assert _check_prefill(maker, free_and_evictable + 50)[0]
    assert maker.alloc.size >= size + 50 and maker.memory.offloaded_groups > 0
    assert dm.counts["admission_offloads"] == 1
    assert dm.log.recent()[-1]["site"] == "admission"


def test_running_batch_sets_w_and_victims_are_priced_as_retraction_frees_them(maker):
    """Issue 9.4: w of Eq. 3 is the smallest remaining budget of the RUNNING requests, not of the
    batch being admitted. Issue 9.3: a victim frees its rows beyond the cache-protected prefix."""
    dm = maker.make()
    maker.scheduler.running_batch.reqs = [request(5), request(40)]
    admitted = SimpleNamespace(reqs=[request(100)])
    snap = dm.snapshot(10, "prefill", admitted, maker.tree, dm.inputs.coefficients(), free_tokens=0)
    assert snap.offload.decode_budget_min == 5
    running = SimpleNamespace(reqs=[request(5, output=3, prompt=50, protected=40),
                                    request(9, output=8, prompt=30, protected=30)])
    snap = dm.snapshot(4, "decode", running, maker.tree, dm.inputs.coefficients(), free_tokens=2)
    # SGLang keeps the request with the most output (8) and retracts the other first
    assert [(v.tokens, v.partial_tokens, v.decode_tokens) for v in snap.preempt] == [(13, 13, 1)]
    assert snap.retract_buffer_tokens == 20 and snap.free_tokens == 2


def test_with_a_draft_the_snapshot_carries_sglangs_accept_length(maker, monkeypatch):
    """Issue 46: Eq. 3 spreads a verify step's staging over the tokens it commits, read from SGLang's counters."""
    dm = maker.make()
    maker.scheduler.running_batch.reqs = [request(40)]
    assert dm.snapshot(10, "prefill", None, maker.tree, dm.inputs.coefficients(), 0).offload.accept_length == 1.0
    maker.scheduler.spec_algorithm = SpeculativeAlgorithm.EAGLE
    monkeypatch.setattr(runtime_context, "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=4,
                                                                            max_speculative_num_draft_tokens=None))
    maker.scheduler.metrics_reporter = SimpleNamespace(spec_total_num_accept_tokens=20, spec_total_num_forward_ct=8,
                                                       spec_num_accept_tokens=10, spec_num_forward_ct=2)
    snap = dm.snapshot(10, "prefill", None, maker.tree, dm.inputs.coefficients(), free_tokens=0)
    assert (snap.offload.accept_length, snap.offload.decode_budget_min) == (3.0, 40)


def test_paged_decode_plans_only_for_the_pages_it_needs(vamp):  # noqa: F811
    """Issue 9.7: prepare_for_decode asks for a page per request although only new pages are needed."""
    _, alloc, memory = vamp.build(16)
    tree, scheduler = tree_and_scheduler(alloc, page_size=16)
    runtime = VampRuntime(scheduler, VampConfig(max_offload_ratio=0.5), 0, False)
    runtime.expert_memory = memory
    dm = DecisionMaker(runtime, memory, RankController(0, 1, None), 2)
    held = alloc.alloc(alloc.available_size() - 32)
    assert held is not None and alloc.available_size() == 32
    batch = SimpleNamespace(reqs=[request(9)] * 4, new_tokens_required_next_decode=lambda: 16)
    dm.on_shortfall(EVICT, alloc, tree, 4 * 16, "decode", batch)  # 64 asked, 16 needed, 32 free
    assert dm.log.recent() == [] and memory.offloaded_groups == 0
    tree.reset()


@pytest.fixture
def two_ranks():
    """Two ranks' agreement rounds over real ipc sockets."""
    import shutil

    from vamp_sglang.controller import make_private_ipc_dir

    ipc_dir = make_private_ipc_dir()
    controllers = [RankController(rank, 2, ipc_dir, timeout_s=0.2) for rank in range(2)]
    step = SimpleNamespace(now=0)
    yield [RankRounds(ctl, lambda: step.now) for ctl in controllers], step
    for ctl in controllers:
        ctl.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)


def on_both(rounds, call):
    """Run `call(rank, rounds)` on both ranks at once; their results by rank."""
    import threading

    out = [None, None]
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, call(r, rounds[r]))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_rank_refusing_a_remap_rolls_the_others_back_without_injecting_into_the_undo(two_ranks):
    """Found by the soak (TP 2, remap:0.2): rank 0's remap failed, rank 1's undo then drew an
    injected fault too and the exception took the scheduler down."""
    rounds, _ = two_ranks
    undone = []

    def apply(rank):
        def run(tokens):
            if rank == 0:
                raise RuntimeError("this rank's remap failed")
        return run

    def undo(rank, r):
        def run():
            r.faults.check("remap", "the undo")  # a compensating remap is not fault-injected
            undone.append(rank)
        return run

    for r in rounds:
        r.faults = Faults.parse("remap:1", seed=0)
    assert on_both(rounds, lambda rank, r: r.remap(100, apply(rank), undo(rank, r))) == [0, 0]
    assert undone == [1] and all(r.undo_failures == 0 for r in rounds)


def test_a_late_rank_means_no_remap_anywhere_and_later_rounds_still_agree(two_ranks):
    """VAMP_SGLANG_FAULT=agree-timeout: a rank arrives too late for its round, over real sockets."""
    rounds, step = two_ranks
    rounds[1].faults = Faults.parse("agree-timeout:1", seed=0)

    def round_on_both(proposals):
        return on_both(rounds, lambda rank, r: r.agree(proposals[rank]))

    assert round_on_both((100, 50)) == [0, 0]  # rank 1 was late: nobody remaps
    assert rounds[1].faults.fired["agree-timeout"] == 1 and rounds[0].missed == 1
    rounds[1].faults = Faults.parse(None)
    ids = [r.round_id for r in rounds]  # both back off alike: no rounds (no time-outs) for a while
    assert round_on_both((100, 50)) == [0, 0] and [r.round_id for r in rounds] == ids
    step.now = ROUND_BACKOFF_STEPS
    assert round_on_both((100, 50)) == [50, 50]  # then the rounds resume in step


def test_the_tpot_guard_caps_what_a_decision_may_offload(maker):
    """--vamp-tpot-slo-ms: no offload whose projected TPOT (measured step + measured staging per
    group) would pass the SLO; the snapshot records the cap, so explain shows it."""
    import dataclasses

    maker.runtime.config = dataclasses.replace(maker.runtime.config, tpot_slo_ms=100.0)
    dm = maker.make()
    assert dm.inputs.guard_cap_groups() == dm.inputs.view.headroom_groups  # nothing measured yet: no cap
    dm.measurements.guard.observe_decode_step(85.0, 0)
    dm.measurements.guard.observe_staging(1, 3.0)  # 3 ms per offloaded group per step
    assert dm.inputs.guard_cap_groups() == 1  # 85 + 3 <= 0.9 x 100 < 85 + 2 * 3
    cache_prompts(maker, 2, 10)
    free = maker.alloc.available_size()
    snap = dm.snapshot(free + 400, "prefill", None, maker.tree, dm.inputs.coefficients(), free)
    assert snap.tpot_guard_groups == 1 and snap.offloadable_groups == 1
    dm.measurements.guard.observe_decode_step(400.0, 0)
    assert dm.inputs.guard_cap_groups() == 0
    assert dm.stats()["tpot_guard"]["cap_groups"] == 0


def test_an_error_in_restore_bookkeeping_never_reaches_the_scheduler(maker, monkeypatch):
    from vamp_sglang.integration.memory import compaction

    dm = maker.make()
    offload_and_cache_the_tail(maker, groups=2, prompts=2, tokens_each=30)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in compaction")

    monkeypatch.setattr(compaction, "compact_tail", broken)
    go_idle_for_11_s(maker.scheduler, monkeypatch)  # 11 s idle: would raise into SGLang's event loop before
    assert dm.counts["errors"] == 1 and maker.memory.offloaded_groups == 2
