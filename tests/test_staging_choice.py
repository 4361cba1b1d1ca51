"""The host's staging chooser compares like with like (issue 19 item 12): whole and routed step times
taken next to each other in the same token bucket, per token, never a fresh sample against a stale one."""

from vamp_sglang.memory.staging_choice import ROUTED, WHOLE, StagingChooser

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
