"""What speculative decoding changes in VAMP's pricing and stats, without SGLang (issue 46).

- A busy restore leaves free, per running request, SGLang's retraction buffer and, with a draft, the rows its
  next draft and verify take ahead (`decode_reserve_tokens`, SGLang's `get_alloc_reserve_per_decode`: twice
  the draft tokens): a restore that left only the former would be undone by the very next step's shortfall.
- `/vamp/stats` `speculation` reports SGLang's mean accept length over the lifetime totals and the window its
  metrics reporter has not logged yet.
"""

from types import SimpleNamespace

from vamp_sglang.integration.memory.draft_pools import SpeculationStats
from vamp_sglang.policy.restore import RestoreState, decode_reserve_tokens, plan_restore

RETRACT_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS's default
DRAFT_RESERVE = 8  # get_alloc_reserve_per_decode with --speculative-num-draft-tokens 4


def test_the_decode_reservation_covers_the_draft_tokens():
    assert decode_reserve_tokens(3, RETRACT_STEPS) == 60
    assert decode_reserve_tokens(3, RETRACT_STEPS, DRAFT_RESERVE) == 84
    assert decode_reserve_tokens(0, RETRACT_STEPS, DRAFT_RESERVE) == 0


def test_a_calm_restore_that_fits_only_without_the_draft_reserve_waits():
    """Four running requests, a smaller pool keeping 90 rows past those in use: enough for the retraction
    buffer (80), not for it and the draft tokens (112), and a calm restore never evicts to make room."""
    def state(reserve_tokens):
        return RestoreState(idle=False, idle_s=0.0, calm_steps=50, tpot_over_slo=False, restore_after_steps=20,
                            offloaded_groups=2, expand_groups=1, pool_tokens=1000, keep_tokens=600, used_tokens=510,
                            evictable_tokens=100, baseline_tokens=500, tail_free=True, can_compact=True,
                            reserve_tokens=reserve_tokens)

    plain = plan_restore(state(decode_reserve_tokens(4, RETRACT_STEPS)))
    spec = plan_restore(state(decode_reserve_tokens(4, RETRACT_STEPS, DRAFT_RESERVE)))
    assert (plain.groups, plain.evict_tokens) == (1, 0)
    assert spec.groups == 0 and "never evicts" in spec.reason


def test_the_accept_length_counts_the_window_not_logged_yet():
    reporter = SimpleNamespace(spec_total_num_accept_tokens=30, spec_total_num_forward_ct=10,
                               spec_num_accept_tokens=9, spec_num_forward_ct=3)
    scheduler = SimpleNamespace(metrics_reporter=reporter, spec_algorithm=SimpleNamespace(name="EAGLE"))
    assert SpeculationStats(scheduler).stats() == {
        "speculation": {"algorithm": "EAGLE", "verify_steps": 13, "accept_length": 3.0}}
    reporter.spec_total_num_forward_ct = reporter.spec_num_forward_ct = 0
    assert SpeculationStats(scheduler).stats()["speculation"]["accept_length"] is None
