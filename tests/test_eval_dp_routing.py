"""The eval client keeps a session on one DP rank (DP attention): SGLang's `routed_dp_rank` request field,
chosen per session by a stable hash (`--dp-sticky N`) or pinned (`--dp-rank R`); a stub server records the
bodies the replay posts."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from eval import client
from eval.bench import add_workload_args, specs_from_args
from eval.multiturn import MultiTurnSpec, generate_multiturn
from eval.replay import Replayer, ReplayOptions
from eval.synth import TokenSpace


def test_a_sessions_rank_is_stable_and_spread_and_a_pin_wins():
    ranks = [client.dp_rank_for(f"s{i}", 2) for i in range(8)]
    assert ranks == [client.dp_rank_for(f"s{i}", 2) for i in range(8)] and set(ranks) == {0, 1}
    assert sorted(ranks) == [0, 0, 0, 0, 1, 1, 1, 1]  # the multiturn workload's 8 sessions: 4 per rank
    assert client.dp_rank_for("s3", 1) is None and client.dp_rank_for("s3", 0) is None  # SGLang balances
    assert client.dp_rank_for("s3", 4, pinned=0) == 0


async def _replay(options):
    bodies = []

    async def generate(request):
        body = await request.json()
        bodies.append(body)
        out = {"output_ids": [7, 8], "meta_info": {"completion_tokens": 2, "prompt_tokens": len(body["input_ids"])}}
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(f"data: {json.dumps(out)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/generate", generate)
    trace = generate_multiturn(MultiTurnSpec(sessions=4, turns=2, first_turn_tokens=8, turn_growth_tokens=2,
                                             output_tokens=2, block_tokens=4))
    async with TestServer(app) as server, aiohttp.ClientSession() as http:
        replay = Replayer(trace, ReplayOptions(str(server.make_url("")).rstrip("/"), progress=False, **options),
                          TokenSpace.for_vocab(1000))
        await replay.run(http)
    return bodies


@pytest.mark.parametrize("options, expected", [
    ({}, None),
    ({"dp_sticky": 2}, "hash"),
    ({"dp_rank": 0}, 0),
])
def test_the_replay_sends_each_sessions_turns_to_its_dp_rank(options, expected):
    bodies = asyncio.run(_replay(options))
    assert len(bodies) == 8
    if expected is None:
        assert all("routed_dp_rank" not in b for b in bodies)
    elif expected == "hash":
        by_prompt = {tuple(b["input_ids"][:8]): b["routed_dp_rank"] for b in bodies}
        assert len(by_prompt) == 4 and set(by_prompt.values()) <= {0, 1}  # each session's two turns agree
    else:
        assert {b["routed_dp_rank"] for b in bodies} == {0}


def test_bench_flags_reach_the_replay_and_bad_ones_are_refused():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int)
    add_workload_args(parser)
    _, options = specs_from_args(parser.parse_args(["--dp-sticky", "2"]), "http://x")
    assert (options.dp_sticky, options.dp_rank) == (2, None)
    with pytest.raises(ValueError, match="--dp-sticky and --dp-rank must be >= 0"):
        specs_from_args(parser.parse_args(["--dp-rank", "-1"]), "http://x")
