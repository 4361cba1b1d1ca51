"""The controller's wire format: every message round-trips, and anything else is rejected by name."""

import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vamp_sglang.controller.messages import (
    PURPOSE,
    Decision,
    MalformedMessage,
    Outcome,
    Proposal,
    Vote,
    decode,
    encode,
)

# No per-example deadline: on a shared 2-core machine one slow example failed the run (a flake, not a bug:
# 20000 examples pass without it).
counts = st.integers(min_value=0, max_value=2**40)
ranks = st.tuples() | st.lists(st.integers(0, 1023), max_size=8).map(tuple)
purposes = st.from_regex(PURPOSE, fullmatch=True)


@settings(deadline=None)
@given(counts, counts, counts, purposes)
def test_proposal_round_trips(round_id, rank, tokens, purpose):
    message = Proposal(round_id, rank, tokens, purpose)
    assert decode(encode(message)) == message


@settings(deadline=None)
@given(counts, counts, ranks, ranks, purposes)
def test_decision_round_trips(round_id, tokens, missing, mismatched, purpose):
    message = Decision(round_id, tokens, missing, mismatched, purpose)
    assert decode(encode(message)) == message


@settings(deadline=None)
@given(counts, counts, st.booleans(), purposes)
def test_vote_round_trips(round_id, rank, ok, purpose):
    message = Vote(round_id, rank, ok, purpose)
    assert decode(encode(message)) == message


@settings(deadline=None)
@given(counts, st.booleans(), ranks, ranks, purposes)
def test_outcome_round_trips(round_id, commit, missing, mismatched, purpose):
    message = Outcome(round_id, commit, missing, mismatched, purpose)
    assert decode(encode(message)) == message


TAG_FIELDS = {"Proposal": {"purpose": ""}, "Vote": {"purpose": ""}, "Decision": {"mismatched": (), "purpose": ""},
              "Outcome": {"mismatched": (), "purpose": ""}}


def _packed(**fields):
    """A hand-packed message; its round tag fields are well-formed unless the case sets them."""
    return msgpack.packb({**TAG_FIELDS.get(fields.get("type"), {}), **fields}, use_bin_type=True)


@pytest.mark.parametrize("data, reason", [
    (b"\xc1", "not a msgpack message"),
    (encode(Proposal(1, 1, 5)) + b"\x00", "not a msgpack message"),  # trailing bytes
    (_packed(type="Proposal", round_id=1, rank=1, tokens=5)[:-1], "not a msgpack message"),  # truncated
    (msgpack.packb([1, 1, 5]), "must be a msgpack map"),
    (_packed(round_id=1, rank=1, tokens=5), "unknown message type None"),
    (_packed(type="Launch", round_id=1), "unknown message type 'Launch'"),
    (_packed(type=7, round_id=1), "unknown message type 7"),
    (_packed(type="Proposal", round_id=1, rank=1), "missing field tokens"),
    (_packed(type="Proposal", round_id=1, rank=1, tokens=5, extra=0), "unknown field extra"),
    (_packed(type="Proposal", round_id="1", rank=1, tokens=5), "Proposal.round_id must be an int (got str)"),
    (_packed(type="Proposal", round_id=1, rank=1, tokens=5.0), "Proposal.tokens must be an int (got float)"),
    (_packed(type="Proposal", round_id=1, rank=True, tokens=5), "Proposal.rank must be an int (got bool)"),
    (_packed(type="Proposal", round_id=1, rank=1, tokens=-5), "Proposal.tokens must be >= 0 (got -5)"),
    (_packed(type="Vote", round_id=1, rank=1, ok=1), "Vote.ok must be a bool (got int)"),
    (_packed(type="Decision", round_id=1, tokens=5, missing=3), "Decision.missing must be a tuple"),
    (_packed(type="Decision", round_id=1, tokens=5, missing=["a"]), "Decision.missing[] must be an int"),
    (_packed(type="Outcome", round_id=1, commit=True, missing=(1,), x=b"\x00"), "not a msgpack message"),
    (_packed(type="Outcome", round_id=1, commit=True, missing=(), mismatched=(-1,)),
     "Outcome.mismatched[] must be >= 0"),
    (_packed(type="Vote", round_id=1, rank=1, ok=True, purpose=7), "Vote.purpose must match"),
    (_packed(type="Proposal", round_id=1, rank=1, tokens=5, purpose="agree view"), "Proposal.purpose must match"),
    (_packed(type="Decision", round_id=1, tokens=5, missing=(), purpose="x" * 33), "Decision.purpose must match"),
    (b"\x90" * 5000, "exceeds 4096 bytes"),
])
def test_malformed_bytes_are_rejected_with_the_reason(data, reason):
    with pytest.raises(MalformedMessage, match=re.escape(reason)):
        decode(data)


def test_a_bad_message_cannot_be_built_or_encoded():
    with pytest.raises(MalformedMessage, match="Vote.rank must be >= 0"):
        Vote(1, -1, True)
    with pytest.raises(MalformedMessage, match="Decision.missing must be a tuple"):
        Decision(1, 0, [1])
    with pytest.raises(TypeError, match="not a controller message"):
        encode({"type": "Proposal", "round_id": 1, "rank": 1, "tokens": 5})


@settings(deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_to_a_message_or_malformed(data):
    try:
        assert type(decode(data)) in (Proposal, Decision, Vote, Outcome)
    except MalformedMessage:
        pass


plain = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=4)


@settings(deadline=None)
@given(st.sampled_from(["Proposal", "Decision", "Vote", "Outcome", "x"]),
       st.dictionaries(st.sampled_from(["round_id", "rank", "tokens", "ok", "commit", "missing", "mismatched",
                                        "purpose", "y"]), plain))
def test_arbitrary_maps_decode_to_a_message_or_malformed(kind, fields):
    try:
        message = decode(msgpack.packb({"type": kind, **fields}, use_bin_type=True))
    except MalformedMessage:
        return
    assert type(message).__name__ == kind
