"""Prompt synthesis: equal hash ids give equal tokens; a later turn extends the previous context."""

from eval.multiturn import MultiTurnSpec, generate_multiturn
from eval.synth import TokenSpace, new_turn_tokens, prompt_ids
from eval.trace_format import TraceRequest

SPACE = TokenSpace.for_vocab(2048)


def test_equal_leading_hash_ids_give_equal_prefixes():
    a = TraceRequest("a", 0, None, None, 100, 4, (0, 1, 2, 3), 32)
    b = TraceRequest("b", 0, None, None, 90, 4, (0, 1, 9), 32)
    ids_a, ids_b = prompt_ids(a, SPACE), prompt_ids(b, SPACE)
    assert len(ids_a) == 100 and len(ids_b) == 90
    assert ids_a[:64] == ids_b[:64]
    assert ids_a[64:90] != ids_b[64:90]
    assert all(SPACE.low <= t < SPACE.high for t in ids_a + ids_b)


def test_same_hash_id_same_tokens_in_another_session_and_run():
    a = TraceRequest("a", 0, None, None, 64, 4, (5, 6), 32)
    b = TraceRequest("z", 0, None, None, 64, 4, (6, 5), 32)
    assert prompt_ids(a, SPACE)[32:] == prompt_ids(b, SPACE)[:32]
    assert prompt_ids(a, SPACE) == prompt_ids(a, SPACE)


def test_next_turn_extends_prompt_and_answer():
    spec = MultiTurnSpec(sessions=1, turns=3, first_turn_tokens=100, turn_growth_tokens=20, output_tokens=8,
                         block_tokens=16)
    t0, t1, _ = generate_multiturn(spec)
    context = prompt_ids(t0, SPACE) + [7] * 8  # the server's answer
    new = new_turn_tokens(t1, len(context), SPACE)
    assert len(context + new) == t1.input_tokens == 128
    # the new user tokens are the ones turn 1's own hash ids put at those positions
    assert new == prompt_ids(t1, SPACE)[108:]


def test_context_longer_than_trace_still_adds_user_tokens():
    request = TraceRequest("a", 1, None, None, 50, 4, (1, 2), 32)
    new = new_turn_tokens(request, 70, SPACE, min_new_tokens=5)
    assert len(new) == 5
