"""The decision layer's wiring into SGLang's call sites, on the same real pool, tree and experts as
tests/test_decisions.py (issue 19 items 3, 8 and 16): what each hook feeds, and what may never escape.
"""

import time
from types import SimpleNamespace

import pytest
import torch

from tests.test_decisions import (  # noqa: F401 (fixtures)
    EVICT,
    allocator_context,
    cache_prompts,
    decisions_over,
    go_idle_for_11_s,
    maker,
    offload_and_cache_the_tail,
    on_both,
    two_ranks,
)
from tests.test_integration_memory import (  # noqa: F401 (fixtures)
    H,
    fused_shared_experts,
    moe_outputs,
    router_outputs,
    sglang_moe,
    vamp,
)
from vamp_sglang.config import VampConfig
from vamp_sglang.integration import runtime
from vamp_sglang.integration.cache import radix_backend, radix_eviction, radix_tree
from vamp_sglang.integration.decisions import decision_hooks, step_measurements
from vamp_sglang.integration.runtime import VampRuntime
from vamp_sglang.policy import Coefficients


def batch(decode: bool, extend_tokens: int = 0):
    """What the run_batch hook reads of SGLang's batch: its forward mode and its prefill tokens."""
    mode = SimpleNamespace(is_decode=lambda: decode, is_extend=lambda: not decode)
    return SimpleNamespace(forward_mode=mode, extend_num_tokens=extend_tokens)


def run_on(scheduler, overlap=False, schedule_stream=None, forward_stream=None):
    """The scheduler fields that say which loop runs the forward, and on which streams."""
    vars(scheduler).update(enable_overlap=overlap, pp_group=SimpleNamespace(world_size=1),
                           schedule_stream=schedule_stream, forward_stream=forward_stream)


def test_a_decision_log_write_that_raises_never_reaches_sglangs_allocator(maker, monkeypatch):  # noqa: F811
    """Issue 19.8: the log write ran after the decision's rounds, outside every guard: a full disk on
    one rank raised through `evict_to_free_tokens` (and skipped that rank's next rounds)."""
    dm = maker.make()
    cache_prompts(maker, 10, 10)
    assert maker.alloc.alloc(maker.alloc.available_size()) is not None

    def full_disk(**entry):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dm.log, "record", full_disk)
    for _ in range(2):
        need = maker.alloc.available_size() + 25
        dm.on_shortfall(EVICT, maker.alloc, maker.tree, need, "prefill", None)
        assert maker.alloc.available_size() >= need
    assert dm.counts["log_errors"] == 2 and dm.stats()["failures"]["decision_log"] == 2
    assert dm.counts["errors"] == 0  # the decisions themselves went through


def test_run_batch_times_a_prefill_on_the_stream_the_loop_runs_the_forward_on(maker, monkeypatch):  # noqa: F811
    """Issue 19.3: the hook timed on `scheduler.forward_stream` in both loops; without overlap the
    forward runs on `schedule_stream`, and events on the idle forward stream read about 0."""
    dm = maker.make()
    timer, streams = dm.measurements.prefill_timer, []
    measure = timer.measure

    def noting_the_stream(tokens, stream=None):
        streams.append(stream)
        return measure(tokens, stream)

    monkeypatch.setattr(timer, "measure", noting_the_stream)
    run_on(maker.scheduler, schedule_stream="schedule_stream", forward_stream="forward_stream")
    prefill = batch(decode=False, extend_tokens=64)
    decision_hooks._around_run_batch(lambda scheduler, batch: None, maker.scheduler, prefill)
    maker.scheduler.enable_overlap = True
    decision_hooks._around_run_batch(lambda scheduler, batch: None, maker.scheduler, prefill)
    assert streams == ["schedule_stream", "forward_stream"]
    assert dm.measurements.calibrator.prefill_samples == 2  # both readings reached t_prefill


def test_each_forward_feeds_c_eff_from_the_staging_wait_it_caused(maker, vamp):  # noqa: F811
    """Issue 19.16: c_reload of Eq. 3 comes from `after_forward`, through the run_batch hook."""
    dm = maker.make()
    memory = maker.memory
    memory.offload(1, memory.tokens_for(1))
    g = torch.Generator().manual_seed(3)
    x, topk = torch.randn(16, H, generator=g), router_outputs(g, 16)
    run_on(maker.scheduler)
    decode = batch(decode=True)
    before_s = float(memory.experts.engine.stats().wait_s)
    decision_hooks._around_run_batch(lambda s, b: moe_outputs(vamp.layers, vamp.experts, x, topk),
                                     maker.scheduler, decode)
    waited_s = float(memory.experts.engine.stats().wait_s) - before_s
    calibrator, shards = dm.measurements.calibrator, memory.layout.group_experts
    assert memory.experts.engine.stats().bytes_staged > 0 and calibrator.staging_samples == 1
    assert calibrator.c_eff_s == pytest.approx(waited_s / shards)
    want = calibrator.c_eff_s * memory.layout.local_experts / dm.top_k
    assert dm.inputs.coefficients().c_reload_s == pytest.approx(want)


def test_t_queue_runs_from_sglangs_retraction_to_the_re_admission(maker, monkeypatch):  # noqa: F811
    """Issue 19.16: t_queue of Eq. 4 as section V observes it, through the retract_decode hook and the
    admission hook SGLang's PrefillAdder calls."""
    dm = maker.make()
    clock = [100.0]
    monkeypatch.setattr(step_measurements.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(runtime, "_current", maker.runtime)
    req = SimpleNamespace(rid="r1", full_untruncated_fill_ids=[1] * 8,
                          last_node=radix_tree.tree_core_of(maker.tree).root_node.id)
    decision_hooks._around_retract_decode(lambda batch: ([req], 0.0, []), SimpleNamespace())
    clock[0] += 2.5
    runtime._after_prefill_admission(None, None, req, SimpleNamespace(prefix_len=0))
    queue = dm.measurements.calibrator.queue
    assert queue.observations == 1 and dm.inputs.coefficients().t_queue_s == pytest.approx(queue.value_s)
    assert queue.value_s != dm.base_coefficients.t_queue_s


def test_setup_scheduler_gives_the_tree_the_runtimes_one_hit_rate_ledger(maker):  # noqa: F811
    """Issue 19.16: Eq. 1's observed hit rate is one ledger, the runtime's, which our tree records into
    once `radix_backend.setup_scheduler` wired it; a second ledger would let /vamp/stats and the planner differ."""
    fresh = VampRuntime(maker.scheduler, VampConfig(max_offload_ratio=0.5), 0, False)
    radix_backend.setup_scheduler(maker.scheduler, fresh)
    assert fresh.vamp_tree is maker.tree and radix_tree.tree_core_of(maker.tree).vamp_ledger is fresh.ledger
    root = radix_tree.tree_core_of(maker.tree).root_node.id
    fresh.on_admission(SimpleNamespace(full_untruncated_fill_ids=[1] * 10, last_node=root), 6, first=True)
    fresh.on_admission(SimpleNamespace(full_untruncated_fill_ids=[1] * 10, last_node=root), 6, first=False)
    assert fresh.ledger.hit_rate == pytest.approx(0.6) and fresh.radix_stats()["hit_rate"] == pytest.approx(0.6)


def test_eviction_candidates_are_taken_until_they_cover_the_need_with_no_fixed_cap(maker):  # noqa: F811
    """Issue 19.16: a gap that takes 180 one-token leaves gets 180 candidates (a cap would make the
    planner think eviction cannot cover it, and offload or preempt instead)."""
    cache_prompts(maker, 190, 1)
    candidates = radix_eviction.eviction_candidates(maker.tree, gap_tokens=180, free_tokens=0, running_requests=1,
                                           retract_buffer_tokens=0)
    assert len(candidates) == 180 and sum(c.tokens for c in candidates) == 180


def test_an_idle_poll_ends_the_chain_of_decode_steps(maker, monkeypatch):  # noqa: F811
    """The TPOT guard's interval runs from one decode step to the next; an idle gap is no step time."""
    import dataclasses

    maker.runtime.config = dataclasses.replace(maker.runtime.config, tpot_slo_ms=100.0)
    dm = maker.make()
    clock = [time.perf_counter()]
    monkeypatch.setattr(step_measurements.time, "perf_counter", lambda: clock[0])
    dm.measurements.before_decode_step()
    clock[0] += 0.020
    dm.measurements.before_decode_step()
    maker.scheduler.is_fully_idle = lambda: True
    decision_hooks._before_on_idle(maker.scheduler)
    clock[0] += 30.0
    dm.measurements.before_decode_step()
    assert dm.measurements.guard.step_ms == pytest.approx(20.0)


class StreamOrder:
    """Stands for a CUDA stream in the order checks below: notes every wait into a shared journal."""

    def __init__(self, name, journal):
        self.name, self.journal = name, journal

    def wait_stream(self, other):
        self.journal.append(f"{self.name} waits for {other.name}")


def test_a_busy_restore_moves_rows_only_after_the_forward_run_batch_launched(maker, monkeypatch):  # noqa: F811
    """Issue 19.7: under the overlap scheduler the busy restore runs right after `run_batch` launched the
    next forward, which may still write rows of a request that just finished (its nodes unlocked);
    compaction copied them with nothing ordering the copies after that forward."""
    from vamp_sglang.integration.memory import compaction

    dm = maker.make()
    offload_and_cache_the_tail(maker, groups=2, prompts=2, tokens_each=30)
    journal = []
    run_on(maker.scheduler, overlap=True, schedule_stream=StreamOrder("schedule_stream", journal),
           forward_stream=StreamOrder("forward_stream", journal))
    compact = compaction.compact_tail

    def noting_the_compaction(*args, **kwargs):
        journal.append("compact")
        return compact(*args, **kwargs)

    monkeypatch.setattr(compaction, "compact_tail", noting_the_compaction)
    decode = batch(decode=True)
    for _ in range(maker.runtime.config.restore_after_steps):
        decision_hooks._around_run_batch(lambda s, b: None, maker.scheduler, decode)
        maker.scheduler.forward_ct += 1
    assert journal == ["schedule_stream waits for forward_stream", "compact"]
    assert maker.memory.offloaded_groups < 2 and dm.runtime.decisions["restore"] == 1


def test_the_guard_charges_a_decode_step_only_what_it_waited_for_staging(maker, vamp, monkeypatch):  # noqa: F811
    """Issue 19.11: the cost per group was a step's excess over a baseline taken while nothing was
    offloaded, never refreshed: a bigger batch or a prefill chunk in between was charged to the experts.
    Now it is what the decode forward waited for its staging copies, through the run_batch hook."""
    import dataclasses

    maker.runtime.config = dataclasses.replace(maker.runtime.config, tpot_slo_ms=100.0)
    dm = maker.make()
    memory, guard = maker.memory, dm.measurements.guard
    clock = [0.0]
    monkeypatch.setattr(step_measurements.time, "perf_counter", lambda: clock[0])
    run_on(maker.scheduler)
    decode = batch(decode=True)
    idle_forward = lambda s, b: None  # nothing offloaded, nothing staged
    for _ in range(10):  # 30 ms steps with everything resident
        decision_hooks._around_run_batch(idle_forward, maker.scheduler, decode)
        clock[0] += 0.030
    memory.offload(1, memory.tokens_for(1))
    g = torch.Generator().manual_seed(5)
    x, topk = torch.randn(16, H, generator=g), router_outputs(g, 16)
    waits_ms = []
    for _ in range(3):  # 300 ms steps: the batch grew, staging did not get slower
        before_s = float(memory.experts.engine.stats().wait_s)
        decision_hooks._around_run_batch(lambda s, b: moe_outputs(vamp.layers, vamp.experts, x, topk),
                                         maker.scheduler, decode)
        waits_ms.append((float(memory.experts.engine.stats().wait_s) - before_s) * 1e3)
        clock[0] += 0.300
    expected_ms = waits_ms[0]
    for wait_ms in waits_ms[1:]:  # the guard's moving mean
        expected_ms += guard.smoothing * (wait_ms - expected_ms)
    assert guard.ms_per_group == pytest.approx(expected_ms) and expected_ms < 50.0
    assert not guard.wants_restore()


def test_the_guard_cap_is_agreed_each_time_a_decision_evaluates_it(two_ranks):  # noqa: F811
    """Issue 19.11: the cap was agreed once per 256 steps and reused, so a cap agreed while decode was
    fast let offloads go on after a rank's decode slowed. Two ranks over real ipc sockets."""
    from vamp_sglang.integration.decisions.plan_inputs import PlanInputs
    from vamp_sglang.policy.tpot_guard import TpotGuard

    rounds, step = two_ranks
    memory = SimpleNamespace(headroom_groups=lambda: 4, tokens_for=lambda groups: 100 * groups)
    guards = [TpotGuard(100.0, smoothing=1.0) for _ in range(2)]
    inputs = [PlanInputs(memory, rounds[rank], VampConfig(tpot_slo_ms=100.0), SimpleNamespace(guard=guards[rank]),
                         Coefficients(), lambda: step.now, 2) for rank in range(2)]
    on_both(rounds, lambda rank, r: inputs[rank].refresh_view())
    for guard in guards:
        guard.observe_decode_step(50.0, 0)
        guard.observe_staging(1, 10.0)  # 50 + 10 n <= 90: four groups
    assert on_both(rounds, lambda rank, r: inputs[rank].guard_cap_groups()) == [4, 4]
    guards[1].observe_decode_step(65.0, 0)  # rank 1's decode slowed: two groups there
    step.now += 1
    assert on_both(rounds, lambda rank, r: inputs[rank].guard_cap_groups()) == [2, 2]
    assert [i.guard_cap_groups(may_agree=False) for i in inputs] == [2, 2]  # stats read the last agreement


def test_an_over_slo_restore_leaves_the_running_requests_reservations_free(maker, monkeypatch):  # noqa: F811
    """Issue 19.11: the busy restore passes the running batch's decode reservations and the chunked
    prefill's next chunk to the plan, and the smaller pool keeps them free."""
    import dataclasses

    from sglang.srt.environ import envs

    from tests.test_decisions import request

    maker.runtime.config = dataclasses.replace(maker.runtime.config, tpot_slo_ms=100.0)
    dm = maker.make()
    offload_and_cache_the_tail(maker, groups=2, prompts=4, tokens_each=10)
    maker.scheduler.running_batch.reqs = [request(9), request(9)]
    vars(maker.scheduler).update(chunked_req=object(), chunked_prefill_size=16)
    monkeypatch.setattr(dm.measurements.guard, "wants_restore", lambda: True)
    dm.restorer.maybe_restore()
    restore = [d for d in dm.log.recent() if d["site"] == "restore"][-1]
    reserve = 2 * int(envs.SGLANG_RETRACT_DECODE_STEPS.get()) + 16
    assert restore["restore_state"]["reserve_tokens"] == reserve
    assert restore["outcome"]["restored_groups"] > 0
    assert maker.alloc.available_size() >= reserve


def test_a_view_agreed_while_a_rank_was_missing_is_agreed_again_once_the_rounds_resume(two_ranks):  # noqa: F811
    """Reviewer's find: a rank late for the start-up offload round backs every rank off; the view agreed
    right after it (setup_scheduler's refresh) then fell back to no headroom, and only a remap refreshed
    it, so VAMP stayed off for the server's life. Two ranks over real ipc sockets."""
    from vamp_sglang.controller.rounds import ROUND_BACKOFF_STEPS
    from vamp_sglang.faults import Faults
    from vamp_sglang.integration.decisions.plan_inputs import VIEW_RECHECK_STEPS, PlanInputs

    rounds, step = two_ranks
    memory = SimpleNamespace(headroom_groups=lambda: 4, tokens_for=lambda groups: 100 * groups)
    inputs = [PlanInputs(memory, rounds[rank], VampConfig(), SimpleNamespace(guard=None), Coefficients(),
                         lambda: step.now, 2) for rank in range(2)]
    rounds[1].faults = Faults.parse("agree-timeout:1", seed=0)
    assert on_both(rounds, lambda rank, r: r.agree(1, purpose="start-offload")) == [0, 0]
    rounds[1].faults = Faults.parse(None)
    on_both(rounds, lambda rank, r: inputs[rank].refresh_view())  # held back: no headroom agreed
    assert [i.offer().headroom_groups for i in inputs] == [0, 0]
    step.now += max(ROUND_BACKOFF_STEPS, VIEW_RECHECK_STEPS)
    assert [i.offer(may_agree=False).headroom_groups for i in inputs] == [0, 0]  # a stats read holds no round
    assert on_both(rounds, lambda rank, r: inputs[rank].offer().tokens_by_groups) == [(100, 200, 300, 400)] * 2


def test_a_hybrid_models_restore_compacts_the_full_attention_pool_the_trigger_hands_in(vamp, monkeypatch):  # noqa: F811
    """Issue 19.15: the hybrid compaction fix was tested on `compact_tail` with the right pool handed in,
    not on the caller that chooses it. Here the restore trigger itself compacts on a hybrid model, whose
    allocator serves SGLang's HybridLinearKVPool wrapper (it has no K/V buffers of its own): the rows
    must move in the wrapper's full-attention pool, the one VAMP grew, with their bytes."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    from tests.test_integration_memory import HEAD_DIM, KV_HEADS, LAYERS, POOL_TOKENS
    from tests.test_radix_hybrid import req_pool
    from vamp_sglang.integration.memory import expert_memory, expert_memory_hooks

    reqs = req_pool()
    wrapper = HybridLinearKVPool(size=POOL_TOKENS, dtype=torch.float32, page_size=1, head_num=KV_HEADS,
                                 head_dim=HEAD_DIM, full_attention_layer_ids=list(range(LAYERS)), device="cpu",
                                 mamba_pool=reqs.mamba_pool)
    alloc = TokenToKVPoolAllocator(POOL_TOKENS, dtype=torch.float32, device="cpu", kvcache=wrapper, need_sort=False)
    memory = vamp.memory = expert_memory.ExpertMemory(vamp.experts, expert_memory_hooks._process.pool, alloc,
                                                      publish=dict, quiesce=lambda: None)
    ns = decisions_over(alloc, memory, monkeypatch)
    dm = ns.make()
    offload_and_cache_the_tail(ns, groups=1, prompts=2, tokens_each=10)
    full = wrapper.full_kv_pool
    tail_rows = cached_rows(ns.tree)
    for buffer in (*full.k_buffer, *full.v_buffer):
        buffer[tail_rows] = torch.arange(1, tail_rows.numel() + 1, dtype=buffer.dtype)[:, None, None]
    go_idle_for_11_s(ns.scheduler, monkeypatch)
    assert dm.counts["errors"] == 0 and memory.offloaded_groups == 0 and alloc.size == POOL_TOKENS
    moved = cached_rows(ns.tree)
    assert int(tail_rows.max()) > POOL_TOKENS >= int(moved.max())
    for buffer in (*full.k_buffer, *full.v_buffer):
        assert torch.equal(buffer[moved][:, 0, 0], torch.arange(1, moved.numel() + 1, dtype=buffer.dtype))
    ns.tree.reset()


def cached_rows(tree):
    """The KV rows every cached node of `tree` holds, node by node."""
    values = (node.component_data[0].value for node in radix_tree.tree_core_of(tree).device_nodes())
    return torch.cat([v for v in values if v is not None and v.numel()])
