"""Undo log that makes a remap a transaction: every step records its inverse; a failure runs them backwards.

Why: an offload or restore (paper IV-C) is hundreds of unmap/map calls over experts and KV buffers; any
one may fail (out of memory, a rule violation, a rank that refuses). Each component records its steps
in the journal it is given, so the repartitioner rolls back all layers with one reverse pass and no KV
index or expert byte is lost. Called without a journal, a component is atomic on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class RollbackError(RuntimeError):
    """An inverse step failed while undoing a failed transaction: the state is no longer known-good."""


class Journal:
    """Steps done so far, each with its inverse."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def run(self, do: Callable[[], T], undo: Callable[[T], None]) -> T:
        """Run `do`; if it returns, remember `undo(result)` for a rollback."""
        result = do()
        self._undo.append(lambda: undo(result))
        return result

    def record(self, undo: Callable[[], None]) -> None:
        """Remember an inverse for a step the caller already completed."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo every recorded step, newest first; the journal is empty afterwards."""
        while self._undo:
            step = self._undo.pop()
            try:
                step()
            except BaseException as exc:
                raise RollbackError(f"rollback failed with {len(self._undo)} steps left to undo: {exc!r}") from exc

    def __len__(self) -> int:
        return len(self._undo)


@contextmanager
def atomic(journal: Journal | None, on_failure: Callable[[], None] | None = None) -> Iterator[Journal]:
    """Record into `journal` (the caller rolls back), or into a fresh one rolled back here on failure,
    after `on_failure()` (a device synchronise: work queued on pages must end before they are unmapped)."""
    if journal is not None:
        yield journal
        return
    own = Journal()
    try:
        yield own
    except BaseException:
        if on_failure is not None:
            on_failure()
        own.rollback()
        raise
