"""The paper's in-house multi-turn workload (section VI-C) as a trace generator.

c sessions, all issuing turn 0 at t=0, each with the same fixed number of turns (12 in the paper).
Turn k's prompt is turn k-1's prompt, its answer, and `turn_growth_tokens` new user tokens, so the
context grows deterministically: input_k = first + k * (output + growth). Raising c raises the
reusable prefix footprint that must stay in the KV pool, which is what locates the capacity boundary.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from eval.trace_format import TraceRequest

SESSION_ID_STRIDE = 1_000_000  # hash ids of session s are s * stride + block index: no cross-session sharing


@dataclass(frozen=True)
class MultiTurnSpec:
    sessions: int = 16
    turns: int = 12
    first_turn_tokens: int = 512
    turn_growth_tokens: int = 128
    output_tokens: int = 32
    think_time_s: float = 0.0
    block_tokens: int = 64
    shared_prefix_tokens: int = 0  # a system prompt every session starts with (0: none)

    def validate(self) -> MultiTurnSpec:
        for name in ("sessions", "turns", "first_turn_tokens", "output_tokens", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)!r})")
        for name in ("turn_growth_tokens", "think_time_s", "shared_prefix_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)!r})")
        if self.shared_prefix_tokens % self.block_tokens or self.shared_prefix_tokens >= self.first_turn_tokens:
            raise ValueError("--shared-prefix-tokens must be a multiple of --block-tokens and below "
                             f"--first-turn-tokens (got {self.shared_prefix_tokens})")
        return self

    def input_tokens(self, turn: int) -> int:
        return self.first_turn_tokens + turn * (self.output_tokens + self.turn_growth_tokens)

    def max_context_tokens(self) -> int:
        return self.input_tokens(self.turns - 1) + self.output_tokens


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The per-session shape flags (everything but --sessions), shared by eval.bench, the runners and
    eval.make_trace; defaults are MultiTurnSpec's."""
    d = MultiTurnSpec()
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--first-turn-tokens", type=int, default=d.first_turn_tokens)
    parser.add_argument("--turn-growth-tokens", type=int, default=d.turn_growth_tokens)
    parser.add_argument("--output-tokens", type=int, default=d.output_tokens)
    parser.add_argument("--think-time-s", type=float, default=d.think_time_s)
    parser.add_argument("--block-tokens", type=int, default=d.block_tokens)
    parser.add_argument("--shared-prefix-tokens", type=int, default=d.shared_prefix_tokens)


def spec_from_args(args: argparse.Namespace, sessions: int) -> MultiTurnSpec:
    """The MultiTurnSpec the `add_shape_args` flags describe, for `sessions` sessions (not validated)."""
    return MultiTurnSpec(sessions, args.turns, args.first_turn_tokens, args.turn_growth_tokens,
                         args.output_tokens, args.think_time_s, args.block_tokens, args.shared_prefix_tokens)


def _hash_ids(spec: MultiTurnSpec, session: int, input_tokens: int) -> tuple[int, ...]:
    shared_blocks = spec.shared_prefix_tokens // spec.block_tokens
    blocks = math.ceil(input_tokens / spec.block_tokens)
    return tuple(b if b < shared_blocks else (session + 1) * SESSION_ID_STRIDE + b for b in range(blocks))


def generate_multiturn(spec: MultiTurnSpec) -> list[TraceRequest]:
    """Requests ordered turn-major (all turn 0s first), the order in which a closed loop issues them."""
    spec.validate()
    requests = []
    for turn in range(spec.turns):
        for session in range(spec.sessions):
            input_tokens = spec.input_tokens(turn)
            requests.append(TraceRequest(
                f"s{session}", turn, 0.0 if turn == 0 else None, None if turn == 0 else spec.think_time_s,
                input_tokens, spec.output_tokens, _hash_ids(spec, session, input_tokens), spec.block_tokens))
    return requests
