# ruff: noqa: F811  (tests take the imported `model` fixture as an argument)
"""What /vamp/stats counts is served traffic (issue 49): routed steps count (and copy) only the rows of the
step's real tokens, not a CUDA graph's padding, and SGLang's warm-up request and health probes are
excluded, while the cumulative measurements the decisions difference keep counting."""

from types import SimpleNamespace

import torch
from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
from test_staging import HIDDEN, TOP_K, model, offload  # noqa: F401 (model: test_staging's fixture)

from vamp_sglang.integration.decisions.step_measurements import StepMeasurements
from vamp_sglang.integration.metrics.served_traffic import health_probe
from vamp_sglang.integration.staging.host_experts import HostExpertStats
from vamp_sglang.memory.staging import StagingEngine
from vamp_sglang.memory.staging_choice import ROUTED
from vamp_sglang.policy import Coefficients


def routed_step(engine, stores, ids):
    engine.begin_forward(2)  # two real tokens
    for store in stores:
        engine.before_moe(store.layer_id, ids)
        engine.after_moe(store.layer_id)


def padded_ids(boundary, experts):
    """Rows 0-1 (real) select resident experts only; rows 2-3 (padding) select offloaded ones."""
    real = torch.arange(2 * TOP_K).reshape(2, TOP_K) % boundary
    pad = boundary + torch.arange(2 * TOP_K).reshape(2, TOP_K) % (experts - boundary)
    return torch.cat([real, pad])


def test_padded_rows_of_a_replayed_graph_are_neither_copied_nor_counted(model):
    _backend, _weights, layout, stores = model
    offload(stores, layout.bound_groups)
    ids = padded_ids(stores[0].boundary_expert, stores[0].routed_experts)
    trimmed = StagingEngine(stores, "sync", staging="routed", trim_padding=True)
    routed_step(trimmed, stores, ids)
    assert trimmed.stats().by_mode[ROUTED]["bytes"] == 0
    untrimmed = StagingEngine(stores, "sync", staging="routed")  # under DP attention the rows are gathered
    routed_step(untrimmed, stores, ids)
    assert untrimmed.stats().by_mode[ROUTED]["bytes"] > 0


def whole_step(engine, stores):
    engine.begin_forward(1)
    for store in stores:
        engine.before_moe(store.layer_id)
        engine.after_moe(store.layer_id)


def memory_of(engine, host=None):
    return SimpleNamespace(experts=SimpleNamespace(engine=engine, host=host, backend=SimpleNamespace(
        device=torch.device("cpu"))), offloaded_groups=0)


def test_the_warm_up_is_excluded_from_served_figures_at_the_first_idle_after_a_forward(model):
    _backend, _weights, layout, stores = model
    offload(stores, layout.bound_groups)
    engine = StagingEngine(stores, "sync", staging="whole")
    host = HostExpertStats(pairs=40, steps=8)
    measurements = StepMeasurements(SimpleNamespace(tpot_slo_ms=None), memory_of(engine, host),
                                    Coefficients(), warmup=True)
    measurements.idle()  # idle before any request: nothing to exclude yet
    for _ in range(3):  # the warm-up request's steps
        whole_step(engine, stores)
        measurements.after_forward(decode=True)
    warmup = engine.stats()
    assert engine.served_stats() == warmup and warmup.steps == 3
    measurements.idle()
    assert engine.served_stats().steps == 0 and engine.served_stats().bytes_staged == 0
    assert (host.pairs, host.steps) == (0, 0)
    whole_step(engine, stores)  # a served step
    served, total = engine.served_stats(), engine.stats()
    assert served.steps == 1 and served.bytes_staged == total.bytes_staged - warmup.bytes_staged > 0
    assert served.by_mode["whole"]["steps"] == 1 and total.steps == 4
    host.pairs = 5
    measurements.after_forward(decode=True)
    measurements.idle()  # later idles exclude nothing more
    assert engine.served_stats().steps == 1 and host.pairs == 5


def test_without_a_warm_up_request_nothing_is_excluded(model):
    stores = model[3]
    engine = StagingEngine(stores, "sync", staging="whole")
    measurements = StepMeasurements(SimpleNamespace(tpot_slo_ms=None), memory_of(engine), Coefficients(),
                                    warmup=False)
    engine.begin_forward(1)
    measurements.after_forward(decode=False)
    measurements.idle()
    assert engine.served_stats().steps == 1


def test_health_probes_are_excluded_and_served_steps_around_them_kept(model):
    _backend, _weights, layout, stores = model
    offload(stores, layout.bound_groups)
    engine = StagingEngine(stores, "sync", staging="whole")
    host = HostExpertStats()
    measurements = StepMeasurements(SimpleNamespace(tpot_slo_ms=None), memory_of(engine, host), Coefficients(),
                                    warmup=False)
    probe = SimpleNamespace(reqs=[SimpleNamespace(rid=f"{HEALTH_CHECK_RID_PREFIX}_1")])
    served = SimpleNamespace(reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid=f"{HEALTH_CHECK_RID_PREFIX}_2")])
    assert health_probe(probe) and not health_probe(served) and not health_probe(SimpleNamespace(reqs=[]))
    for batch, pairs in ((served, 3), (probe, 7), (served, 2), (probe, 1)):
        whole_step(engine, stores)
        host.pairs += pairs
        host.steps += 1
        measurements.after_forward(decode=False, probe=health_probe(batch))
    per_step = stores[0].staged_bytes() * len(stores)
    assert engine.served_stats().steps == 2 and engine.served_stats().bytes_staged == 2 * per_step
    assert engine.stats().steps == 4 and (host.pairs, host.steps) == (5, 2)
