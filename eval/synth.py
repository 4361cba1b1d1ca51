"""Prompt token ids from hash ids, deterministic per block, so replays share exactly what traces share.

Position p of a request's prompt lies in block p // block_tokens, whose hash id fixes its tokens: equal
hash ids give equal tokens in every session, run and configuration. A later turn of a session is its
previous prompt, the answer the server actually returned (closed loop), then the trace's new tokens,
taken at their own positions from the hash ids, up to `input_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

from eval.trace_format import TraceRequest

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TokenSpace:
    """Prompt tokens are drawn from [low, high): skip the low ids and the special tokens at the end."""

    low: int = 16
    high: int = 1900

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"token space must satisfy 0 <= low < high (got [{self.low}, {self.high}))")

    @classmethod
    def for_vocab(cls, vocab_size: int) -> TokenSpace:
        """Leave the top 5% (at least 64 ids) for special tokens, as small tokenizers put them last."""
        reserved = max(64, vocab_size // 20)
        if vocab_size <= reserved + 16:
            raise ValueError(f"vocab_size {vocab_size} is too small for synthetic prompts")
        return cls(16, vocab_size - reserved)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def block_token(hash_id: int, offset: int, space: TokenSpace) -> int:
    """The token at `offset` inside the block named `hash_id`."""
    return space.low + _splitmix64((hash_id << 24) ^ offset) % (space.high - space.low)


def token_at(request: TraceRequest, position: int, space: TokenSpace) -> int:
    """Positions past the last block keep using it, so an over-long context still gets fresh tokens."""
    block = min(position // request.block_tokens, len(request.hash_ids) - 1)
    return block_token(request.hash_ids[block], position - block * request.block_tokens, space)


def new_turn_tokens(request: TraceRequest, context_tokens: int, space: TokenSpace,
                    min_new_tokens: int = 1) -> list[int]:
    """Tokens to append to a session context of `context_tokens` tokens (0 for turn 0) for this turn.

    The prompt reaches `request.input_tokens` when the context is shorter; when the returned answers
    made it longer already, the turn still adds `min_new_tokens` user tokens.
    """
    end = max(request.input_tokens, context_tokens + min_new_tokens)
    return [token_at(request, p, space) for p in range(context_tokens, end)]


def prompt_ids(request: TraceRequest, space: TokenSpace) -> list[int]:
    """A request's whole prompt when replayed on its own (open loop): its hash-id blocks."""
    return new_turn_tokens(request, 0, space)
