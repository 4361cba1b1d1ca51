"""Importers on the shared public traces (read in place), and the multi-turn generator."""

import itertools
from pathlib import Path

import pytest

from eval.mooncake import import_mooncake
from eval.multiturn import MultiTurnSpec, generate_multiturn
from eval.servers import ensure_tiny_model
from eval.trace_format import dump_trace, load_trace, traces_dir

TRACES = traces_dir()
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"
SWEAGENT = TRACES / "sweagent_demonstrations"
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(),
                                    reason=f"shared Mooncake trace not found at {MOONCAKE} (set VAMP_TRACES_DIR)")
needs_sweagent = pytest.mark.skipif(not SWEAGENT.is_dir(),
                                    reason=f"shared SWE-agent trajectories not found at {SWEAGENT} (set VAMP_TRACES_DIR)")


def _by_session(requests):
    sessions = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    return sessions


@needs_mooncake
def test_mooncake_rebuilds_sessions_as_prefix_chains(tmp_path):
    requests = import_mooncake(MOONCAKE)
    assert len(requests) == 12031
    sessions = _by_session(requests)
    multi = [turns for turns in sessions.values() if len(turns) > 1]
    assert len(multi) > 1000 and max(len(t) for t in multi) >= 12
    for turns in multi:
        assert turns[0].arrival_s is not None and turns[0].think_time_s is None
        for prev, cur in itertools.pairwise(turns):
            shared = max(2, len(prev.hash_ids) - 1)
            assert cur.hash_ids[:shared] == prev.hash_ids[:shared]
            assert cur.arrival_s is None and cur.think_time_s >= 0
    assert all(r.block_tokens == 512 for r in requests)
    path = tmp_path / "mooncake.jsonl"
    dump_trace(requests[:2000], path)
    assert load_trace(path) == requests[:2000]


@needs_mooncake
def test_mooncake_first_request_matches_the_file():
    first = import_mooncake(MOONCAKE, max_requests=1)[0]
    assert (first.input_tokens, first.output_tokens, first.hash_ids[:3]) == (6758, 500, (0, 1, 2))


@needs_sweagent
def test_sweagent_turns_extend_their_history():
    from transformers import AutoTokenizer

    from eval.sweagent import import_sweagent

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(MODEL))
    marshmallow = [next(SWEAGENT.glob(f"replay__*1867__{config}__install-1__*.traj"))
                   for config in ("function_calling", "function_calling_replace")]  # same first prompt
    paths = marshmallow + [SWEAGENT / "ctf__forensics__flash.traj"]
    requests = import_sweagent(paths, tokenizer, block_tokens=64)
    sessions = _by_session(requests)
    assert len(sessions) == 3
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert cur.input_tokens > prev.input_tokens
            full = prev.input_tokens // 64
            assert cur.hash_ids[:full] == prev.hash_ids[:full]  # the history is the previous prompt + more
    marsh = [turns[0] for name, turns in sessions.items() if name.startswith("replay__marshmallow")]
    assert marsh[0].hash_ids == marsh[1].hash_ids  # same first prompt: every block shared
    flash = sessions["ctf__forensics__flash"][0]
    assert flash.hash_ids[0] != marsh[0].hash_ids[0]
    # the tokenizer defines the counts: the first prompt is the chat template over the system and user text
    assert flash.input_tokens > 500


def test_multiturn_structure():
    spec = MultiTurnSpec(sessions=4, turns=12, first_turn_tokens=512, turn_growth_tokens=128, output_tokens=32,
                         block_tokens=64, shared_prefix_tokens=128)
    requests = generate_multiturn(spec)
    assert len(requests) == 48 and [r.turn for r in requests[:4]] == [0] * 4
    sessions = _by_session(requests)
    for turns in sessions.values():
        assert [t.input_tokens for t in turns] == [512 + 160 * k for k in range(12)]
        assert turns[0].arrival_s == 0.0
        for prev, cur in itertools.pairwise(turns):
            assert cur.hash_ids[:len(prev.hash_ids)] == prev.hash_ids
    heads = {turns[0].hash_ids[:3] for turns in sessions.values()}
    assert len({h[:2] for h in heads}) == 1 and len({h[2] for h in heads}) == 4  # only the system prompt shared
    with pytest.raises(ValueError, match="--sessions must be >= 1"):
        generate_multiturn(MultiTurnSpec(sessions=0))
