"""The prior of never-hit nodes (cache/reuse_share.py): observed reuse share per writer class."""

import math

import pytest

from vamp_sglang.cache import ReuseShares, writer_class
from vamp_sglang.cache.reuse_share import PSEUDO_TOKENS


def test_writer_classes_are_quarters_of_the_hit_rate():
    assert [writer_class(r) for r in (0.0, 0.2499, 0.25, 0.5, 0.74, 0.75, 1.0)] == [0, 0, 1, 2, 2, 3, 3]
    assert writer_class(None) is None


def test_a_class_without_evidence_starts_at_the_tree_wide_rate_and_moves_to_what_it_observed():
    shares = ReuseShares()
    shares.refresh(0.6)
    assert shares.prior(0.0) == shares.prior(0.9) == shares.prior(None) == 0.6
    shares.wrote(0.0, 3 * PSEUDO_TOKENS)  # first turns: a third of their tokens came back
    shares.reused(0.0, PSEUDO_TOKENS, 100)
    shares.wrote(0.9, 3 * PSEUDO_TOKENS)  # continuations: all of them
    shares.reused(0.9, 3 * PSEUDO_TOKENS, 100)
    shares.refresh(0.6)
    assert shares.prior(0.1) == pytest.approx((PSEUDO_TOKENS + 0.6 * PSEUDO_TOKENS) / (4 * PSEUDO_TOKENS))
    assert shares.prior(0.8) == pytest.approx((3 * PSEUDO_TOKENS + 0.6 * PSEUDO_TOKENS) / (4 * PSEUDO_TOKENS))
    assert shares.prior(0.3) == 0.6 and shares.prior(None) == 0.6  # no evidence there
    row = shares.snapshot()["0.00-0.25"]
    assert row == {"written_tokens": 3 * PSEUDO_TOKENS, "reused_tokens": PSEUDO_TOKENS, "prior": shares.prior(0.0),
                   "steps_to_first_hit": 100.0}


def test_published_priors_move_only_past_one_publishing_step():
    shares = ReuseShares()
    version = shares.refresh(0.5)
    assert shares.refresh(0.52) == version and shares.prior(None) == 0.5  # within 2^(1/8): kept
    moved = shares.refresh(0.6)
    assert moved > version and shares.prior(None) == 0.6
    shares.refresh(0.0)
    assert shares.prior(None) == 0.0 and shares.prior(0.5) == 0.0
    for rate in (0.01, 0.3, 0.9):
        shares.refresh(rate)
        assert abs(math.log2(shares.prior(None) / rate)) <= 1 / 8


def test_reuse_never_counts_above_what_was_written_and_unknown_writers_are_not_counted():
    shares = ReuseShares()
    shares.wrote(0.4, 100)
    shares.reused(0.4, 500, 0)  # a node split after its write can report more than one write's tokens
    shares.wrote(None, 1000)
    shares.reused(None, 1000, 0)
    assert shares.share(1, 0.0) == pytest.approx(100 / (100 + PSEUDO_TOKENS))
    assert sum(shares.written_tokens) == 100


def test_a_class_interval_is_its_mean_steps_to_a_first_hit_published_in_steps():
    """The reuse interval a never-hit node is expected back after (cache/ordering.py): none until a hit is seen;
    a class with none of its own takes every class's together."""
    shares = ReuseShares()
    shares.refresh(0.5)
    assert shares.gap_steps(0.9) is None and shares.gap_steps(None) is None
    shares.reused(0.9, 64, 100)
    shares.reused(0.9, 64, 300)
    version = shares.refresh(0.5)
    assert shares.gap_steps(0.8) == 200.0 and shares.gap_steps(0.1) == shares.gap_steps(None) == 200.0
    shares.reused(0.1, 64, 1000)
    assert shares.steps_to_first_hit(0) == 1000.0 and shares.steps_to_first_hit(None) == 1400 / 3
    shares.reused(0.9, 64, 230)  # mean 210: within 2^(1/8) of 200, kept
    assert shares.refresh(0.5) > version and shares.gap_steps(0.9) == 200.0  # (class 0's moved)
    version = shares.version
    shares.reused(0.9, 64, 900)  # mean 382.5: published
    assert shares.refresh(0.5) > version and shares.gap_steps(0.9) == 382.5
