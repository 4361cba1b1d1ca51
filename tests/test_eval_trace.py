"""Session-trace format: round trip, validation errors that name line and field, scaling."""

import json

import pytest

from eval.multiturn import MultiTurnSpec, generate_multiturn
from eval.trace_format import TraceFormatError, TraceRequest, dump_trace, load_trace, scale_request

GOOD = {"session": "a", "turn": 0, "arrival_s": 0.5, "think_time_s": None, "input_tokens": 100,
        "output_tokens": 8, "hash_ids": [1, 2], "block_tokens": 64}


def _write(tmp_path, rows):
    path = tmp_path / "t.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_round_trip_keeps_every_field(tmp_path):
    requests = generate_multiturn(MultiTurnSpec(sessions=3, turns=4, think_time_s=1.5))
    requests.append(TraceRequest("x", 0, 12.25, None, 65, 3, (7, 8), 64))
    path = tmp_path / "trace.jsonl"
    dump_trace(requests, path)
    assert load_trace(path) == requests


def test_line_numbers_count_blank_lines(tmp_path):
    bad = GOOD | {"turn": 1, "session": "b", "input_tokens": -3}
    path = _write(tmp_path, [GOOD, "", bad])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:3: .*'input_tokens' must be an integer >= 1 \(got -3\)"):
        load_trace(path)


@pytest.mark.parametrize("change, message", [
    ({"hash_ids": [1]}, r"'hash_ids' must have ceil\(input_tokens / block_tokens\) = 2 entries \(got 1\)"),
    ({"hash_ids": [1, -2]}, r"'hash_ids' must be a list of integers >= 0"),
    ({"arrival_s": "soon"}, r"'arrival_s' must be a finite number >= 0 or null"),
    ({"think_time_s": -1.0}, r"'think_time_s' must be a finite number >= 0 or null"),
    ({"session": ""}, r"'session' must be a non-empty string"),
    ({"turn": True}, r"'turn' must be an integer >= 0"),
    ({"block_tokens": 0}, r"'block_tokens' must be an integer >= 1"),
    ({"extra": 1}, r"unknown field 'extra'"),
])
def test_bad_field_is_named_with_its_line(tmp_path, change, message):
    path = _write(tmp_path, [GOOD | {"session": "ok"}, GOOD | change])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: .*" + message):
        load_trace(path)


def test_missing_field_and_bad_json_are_named(tmp_path):
    row = dict(GOOD)
    del row["output_tokens"]
    with pytest.raises(TraceFormatError, match=r":1: missing field 'output_tokens'"):
        load_trace(_write(tmp_path, [row]))
    with pytest.raises(TraceFormatError, match=r":2: not valid JSON"):
        load_trace(_write(tmp_path, [GOOD, "{oops"]))
    with pytest.raises(TraceFormatError, match=r":1: expected a JSON object"):
        load_trace(_write(tmp_path, ["[1, 2]"]))


def test_turns_must_count_up_per_session(tmp_path):
    rows = [GOOD, GOOD | {"session": "b"}, GOOD | {"turn": 2}]
    with pytest.raises(TraceFormatError, match=r":3: field 'turn' of session 'a' must be 1 \(got 2\)"):
        load_trace(_write(tmp_path, rows))


def test_scale_keeps_block_count_and_sharing():
    request = TraceRequest("a", 0, 0.0, None, 6758, 500, tuple(range(14)), 512)
    small = scale_request(request, 0.05)
    assert small.block_tokens == 26 and small.hash_ids == request.hash_ids
    assert (len(small.hash_ids) - 1) * small.block_tokens < small.input_tokens <= 14 * 26
    assert small.output_tokens == 25
    with pytest.raises(ValueError, match="scale must be in"):
        scale_request(request, 0)
