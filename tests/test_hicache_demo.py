"""eval/hicache_demo.py (issue 22): the request-by-request comparison against the unbounded pool's run."""

from eval.hicache_demo import compare, configs, missed_tokens
from eval.stats import RequestRecord


def _rec(session, turn, prompt, cached, output_ids):
    return RequestRecord(session, turn, True, 0.0, 0.1, 0.2, prompt, len(output_ids), cached, tuple(output_ids))


def _run(second_turn_cached=109, third_output=(5, 6)):
    return [_rec("s0", 0, 100, 0, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)), _rec("s0", 1, 150, second_turn_cached, (3, 4)),
            _rec("s0", 2, 200, 151, third_output), _rec("s1", 0, 100, 0, (9, 9))]


def test_a_full_hit_covers_the_previous_prompt_and_answer_less_its_last_token():
    assert missed_tokens(_run()) == {("s0", 1): 0, ("s0", 2): 0}
    assert missed_tokens(_run(second_turn_cached=60)) == {("s0", 1): 49, ("s0", 2): 0}


def test_differences_are_listed_with_the_re_prefilled_turns_of_their_session():
    reference = _run()
    same = compare(_run(), reference)
    assert same["reference"] and (same["equal"], same["requests"], same["full_hits"], same["later_turns"], same["differ"]) == (4, 4, 2, 2, [])
    other = compare(_run(second_turn_cached=60, third_output=(5, 7)), reference)
    assert other["equal"] == 3 and other["full_hits"] == 1
    assert other["differ"] == [{"session": "s0", "turn": 2, "reprefilled_tokens": 0, "reprefilled_turns_so_far": [1]}]


def test_the_fifth_server_is_stock_with_a_pool_nothing_is_evicted_from():
    runs = configs(0.2, 4.0, 65536)
    assert [c.name for c in runs] == ["stock", "hicache", "vamp-20", "vamp-20+hicache", "unbounded"]
    assert runs[-1].flags == ("--vamp-max-offload-ratio", "0", "--max-total-tokens", "65536")


def test_without_the_unbounded_run_there_is_nothing_to_differ_from():
    alone = compare(_run(third_output=(0,)), None)
    assert not alone["reference"] and alone["differ"] == [] and alone["full_hits"] == 2
