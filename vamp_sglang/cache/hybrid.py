"""What a hybrid prefix cache can reuse, and what evicting one of its nodes loses (paper Eq. 2 on Qwen3-Next).

A hybrid model (Qwen3-Next: Gated DeltaNet linear-attention layers, one full-attention layer in four)
caches two things per prefix: full-attention KV for every token, and the linear-attention state only
where a request checkpointed it (SGLang 0.5.23's `MambaComponent`: after a prefill and at finish, at
the end of the inserted key; a node split leaves the new parent without one). The state cannot be
rebuilt from KV, so a match ends at the DEEPEST node holding a state (`create_match_validator`):
KV below it is re-prefilled anyway. Hence:

- a node's KV is reusable only if it or some node below it still holds a state;
- evicting a leaf with a state loses its own tokens AND those of every ancestor left with no state
  anywhere below (each becomes a stateless leaf that no match can end in);
- evicting a stateless leaf loses nothing: its KV was already dead weight.

`tokens_losing_reuse` is the re-prefill work Eq. 2 prices for a hybrid node, given the nodes an
eviction walk already removed. Pure: works on any tree through `HybridTree`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

N = TypeVar("N")


class HybridTree(Protocol[N]):
    def parent(self, node: N) -> N | None: ...  # None above the root's children

    def children(self, node: N) -> Iterable[N]: ...

    def tokens(self, node: N) -> int: ...  # KV tokens the node holds

    def has_state(self, node: N) -> bool: ...  # a linear-attention state checkpoint at its end


def state_below(tree: HybridTree[N], node: N, gone: set[N]) -> bool:
    """Whether `node` or a node under it, not in `gone`, holds a state (its KV is still reusable)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n in gone:
            continue
        if tree.has_state(n):
            return True
        stack.extend(tree.children(n))
    return False


def tokens_losing_reuse(tree: HybridTree[N], leaf: N, gone: set[N] | None = None) -> int:
    """KV tokens no match can reach any more once `leaf` goes (after the nodes in `gone` went)."""
    gone = set(gone or ()) | {leaf}
    if not tree.has_state(leaf):
        return 0
    lost, node = tree.tokens(leaf), tree.parent(leaf)
    while node is not None and not tree.has_state(node) and not any(
            state_below(tree, c, gone) for c in tree.children(node)):
        lost += tree.tokens(node)
        gone.add(node)
        node = tree.parent(node)
    return lost

