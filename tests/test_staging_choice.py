"""The host's staging chooser compares like with like (issue 19 item 12): whole and routed step times
taken next to each other in the same token bucket, per token, never a fresh sample against a stale one;
and the server's auto choosing host-computed cold experts too (issue 49)."""

import pytest

from vamp_sglang.memory.staging_choice import HOST, ROUTED, WHOLE, StagingChooser

WHOLE_BYTES, ROWS, ROW_BYTES = 32 * 1000, 32, 1000  # one layer: 32 offloaded rows of 1000 bytes


def host_chooser() -> StagingChooser:
    return StagingChooser("auto", top_k=2, experts=128, explore_every_steps=64, measure_steps=True)


def run(chooser: StagingChooser, step: int, tokens: int, seconds_of: dict[str, float]) -> str:
    """One host step: the chooser picks, the step runs and reports its measured time."""
    mode = chooser.choose(step, tokens, WHOLE_BYTES, ROWS, ROW_BYTES)
    if mode == WHOLE:
        chooser.observe_whole(step, tokens, WHOLE_BYTES, copy_s=32e-6, wait_s=0.0)
    chooser.observe_step(step, tokens, mode, seconds_of[mode])
    return mode


def test_a_mode_measured_long_ago_under_a_lighter_load_does_not_beat_the_one_running_now():
    chooser = host_chooser()
    light = {WHOLE: 0.010, ROUTED: 0.008}  # routed is faster
    assert [run(chooser, step, 48, light) for step in (1, 2)] == [WHOLE, ROUTED]
    heavy = {WHOLE: 0.015, ROUTED: 0.012}  # the host gets busier: both slow down, routed still faster
    assert {run(chooser, step, 48, heavy) for step in range(3, 41)} == {ROUTED}
    assert chooser.choose(41, 48, WHOLE_BYTES, ROWS, ROW_BYTES) == ROUTED  # not whole's stale 0.010 s
    for step in range(41, 80):  # whole comes back (the window is re-measured), next to a routed step
        run(chooser, step, 48, heavy)
    assert chooser.choose(80, 48, WHOLE_BYTES, ROWS, ROW_BYTES) == ROUTED


def test_step_times_are_compared_per_token_within_a_bucket():
    chooser = host_chooser()
    assert run(chooser, 1, 63, {WHOLE: 63 * 2e-4}) == WHOLE  # 2e-4 s per token
    assert run(chooser, 2, 33, {ROUTED: 33 * 3e-4}) == ROUTED  # shorter step, but 3e-4 s per token
    assert chooser.choose(3, 48, WHOLE_BYTES, ROWS, ROW_BYTES) == WHOLE


def test_a_fresh_step_is_not_compared_with_one_from_long_ago():
    chooser = host_chooser()
    assert run(chooser, 1, 48, {WHOLE: 0.010}) == WHOLE
    for step in range(2, 60):  # the bucket is idle: other token counts run
        run(chooser, step, 1000, {WHOLE: 0.1, ROUTED: 0.1})
    assert run(chooser, 60, 48, {ROUTED: 0.008}) == ROUTED  # 59 steps after whole's only sample
    assert chooser.choose(61, 48, WHOLE_BYTES, ROWS, ROW_BYTES) == WHOLE  # measured next to it first


# ---- host-computed cold experts in the server's auto (issue 49) -------------------------------------

E, K, OFF_ROWS, ROW = 64, 6, 32, 1_000_000  # one layer: 32 of 64 experts offloaded, 1 MB each
LINK = 10e9  # measured copy rate, bytes/s


def modelled_chooser() -> StagingChooser:
    """A GPU's chooser (costs modelled from measured rates): whole measured with no overlap window, the
    host at 50 us per pair in decode (T=1) and prefill (T=256) buckets alike."""
    chooser = StagingChooser("auto", top_k=K, experts=E, host_capable=True)
    for step, tokens in ((1, 1), (2, 256)):
        chooser.observe_whole(step, tokens, OFF_ROWS * ROW, copy_s=OFF_ROWS * ROW / LINK, wait_s=OFF_ROWS * ROW / LINK)
        pairs = tokens * K // 2
        chooser.observe_host(step, tokens, pairs, pairs * 50e-6)
    return chooser


def test_decode_computes_cold_experts_on_the_host_while_prefill_stages_them():
    chooser = modelled_chooser()
    # T=1: host 1 x 6 x 0.5 x 50 us = 0.15 ms, routed 3 rows x 0.1 ms = 0.3 ms, whole 3.2 ms exposed
    assert chooser.host_s(1, OFF_ROWS) < chooser.routed_s(1, OFF_ROWS, ROW) < chooser.whole_s(1, OFF_ROWS * ROW)
    assert chooser.choose(3, 1, OFF_ROWS * ROW, OFF_ROWS, ROW) == HOST
    # T=256: 768 pairs x 50 us = 38 ms on the host against 3.2 ms to copy the region
    assert chooser.host_s(256, OFF_ROWS) > 10 * chooser.whole_s(256, OFF_ROWS * ROW)
    assert chooser.choose(3, 256, OFF_ROWS * ROW, OFF_ROWS, ROW) in (WHOLE, ROUTED)


def test_a_faster_host_takes_prefill_too_and_a_slower_one_gives_decode_back():
    chooser = StagingChooser("auto", top_k=K, experts=E, host_capable=True)
    for tokens in (1, 256):
        chooser.observe_whole(1, tokens, OFF_ROWS * ROW, copy_s=3.2e-3, wait_s=3.2e-3)
        chooser.observe_host(1, tokens, tokens * K // 2, tokens * K // 2 * 1e-7)  # 0.1 us per pair
    assert chooser.choose(4, 256, OFF_ROWS * ROW, OFF_ROWS, ROW) == HOST
    for step in range(4, 40):  # decode pairs become slow: 1 ms each
        chooser.observe_host(step, 1, 3, 3e-3)
    assert chooser.choose(40, 1, OFF_ROWS * ROW, OFF_ROWS, ROW) == ROUTED


def test_host_is_measured_in_each_bucket_and_re_measured_when_stale():
    chooser = StagingChooser("auto", top_k=K, experts=E, host_capable=True, explore_every_steps=64)
    chooser.observe_whole(1, 16, OFF_ROWS * ROW, copy_s=3.2e-3, wait_s=3.2e-3)
    assert chooser.choose(2, 16, OFF_ROWS * ROW, OFF_ROWS, ROW) == HOST  # no host rate in this bucket yet
    chooser.observe_host(2, 16, 48, 48 * 1e-3)  # far slower than copying
    chooser.observe_whole(3, 16, OFF_ROWS * ROW, copy_s=3.2e-3, wait_s=3.2e-3)
    assert chooser.choose(3, 16, OFF_ROWS * ROW, OFF_ROWS, ROW) != HOST
    chooser.observe_whole(60, 16, OFF_ROWS * ROW, copy_s=3.2e-3, wait_s=3.2e-3)
    assert chooser.choose(66, 16, OFF_ROWS * ROW, OFF_ROWS, ROW) == HOST  # 64 steps after its last sample


def test_the_observed_cold_share_scales_the_expected_pairs():
    chooser = modelled_chooser()
    uniform = chooser.host_s(1, OFF_ROWS)
    for step in range(3, 40):  # residency by routing: the offloaded rows take 5 % of the selections
        chooser.observe_host(step, 1, 0 if step % 3 else 1, 50e-6)
    assert chooser.cold_share < 0.2 and chooser.host_s(1, OFF_ROWS) < uniform / 2


def test_without_host_capable_layers_auto_never_picks_host_and_host_is_refused():
    chooser = StagingChooser("auto", top_k=K, experts=E)
    chooser.observe_whole(1, 1, OFF_ROWS * ROW, copy_s=3.2e-3, wait_s=3.2e-3)
    assert {chooser.choose(s, 1, OFF_ROWS * ROW, OFF_ROWS, ROW) for s in range(2, 10)} == {ROUTED}
    with pytest.raises(ValueError, match="host"):
        StagingChooser("host", top_k=K, experts=E)
    assert StagingChooser("host", top_k=K, experts=E, host_capable=True).choose(1, 1, 1, 1, 1) == HOST


def test_on_the_host_the_three_modes_are_measured_side_by_side_and_the_fastest_runs():
    chooser = StagingChooser("auto", top_k=2, experts=128, measure_steps=True, host_capable=True)
    times = {WHOLE: 0.010, ROUTED: 0.008, HOST: 0.004}
    assert [run(chooser, step, 48, times) for step in (1, 2, 3)] == [WHOLE, ROUTED, HOST]
    assert {run(chooser, step, 48, times) for step in range(4, 65)} == {HOST}
    # every 64 steps the other two run once each next to it (whole also re-measures its window)
    assert [run(chooser, step, 48, times) for step in (65, 66, 67)] == [WHOLE, ROUTED, HOST]
    slower_host = {**times, HOST: 0.02}  # the host gets busy: host keeps running until the next comparison
    assert {run(chooser, step, 48, slower_host) for step in range(68, 129)} == {HOST}
    assert [run(chooser, step, 48, slower_host) for step in (129, 130, 131)] == [WHOLE, ROUTED, ROUTED]
