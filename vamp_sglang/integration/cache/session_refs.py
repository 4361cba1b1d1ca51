"""Session references as SGLang's eviction leaves them, for the read-only walks that predict it.

With `--enable-session-radix-cache` SGLang's device eviction keys leaves by (held by an open session, by how many,
the tree's priority). Evicting a node that is a session's frontier leaf moves that session's reference
(`discard_deleted_session_leaf`; a node HiCache demotes keeps them): to the nearest ancestor a match could still end at, which becomes the frontier
and keeps its count, or, where that ancestor already is one of the session's frontier leaves (a session with two
branches, e.g. a regenerated answer), off every ancestor up to the root. The real eviction keys a parent it then
pushes with the reference it has after that move; a prediction, which removes nothing, must do the same or it
misplaces that parent (tests/test_radix_kept_order.py). `SessionRecede` replays the move on an overlay of counts
and frontiers, one per predicted walk. Only ancestors of a removed node change, so only the parents a walk pushes
need it: the leaves it starts from keep the counts they have.
"""

from __future__ import annotations

from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeNode

_FULL = ComponentType.FULL


class SessionRecede:
    """Session references of the FULL component once the nodes passed to `remove` are gone, tree untouched."""

    def __init__(self, core) -> None:
        self.core, self.full, self.root = core, core.components_by_type[_FULL], core.root_node
        self.lost: dict[UnifiedTreeNode, int] = {}  # node -> references the removals took off it
        self.frontiers: dict[str, set[UnifiedTreeNode]] = {}  # session -> its frontier leaves, once a removal moved them
        self.held: dict[UnifiedTreeNode, set[str]] = {}  # node -> sessions it is a frontier leaf of, once moved

    def refs(self, node: UnifiedTreeNode) -> int:
        return node.component_data[_FULL].session_ref - self.lost.get(node, 0)

    def key(self, node: UnifiedTreeNode, priority: tuple) -> tuple:
        """FullComponent's session-ref key around `priority`, the tree's own key of the node."""
        refs = self.refs(node)
        return (refs > 0, refs, priority)

    def remove(self, node: UnifiedTreeNode) -> None:
        """`node` is evicted: each session it is a frontier leaf of moves as `discard_deleted_session_leaf` moves it.
        A node with a host copy, or any node in HiCache's write-back mode, is demoted instead of deleted
        (`UnifiedTreeCore.evict_device_leaf`), and its references stay where they are."""
        if node.backuped or self.core.is_write_back:
            return
        for session in tuple(self._sessions_of(node)):
            frontier = self._frontier(session)
            fallback = self.full._find_reusable_session_leaf(node.parent)
            if fallback is not None and fallback in frontier:
                fallback = None
            stop, above = fallback if fallback is not None else self.root, node
            while above is not None and above is not stop and above is not self.root:
                self.lost[above] = self.lost.get(above, 0) + 1
                above = above.parent
            frontier.discard(node)
            self._sessions_of(node).discard(session)
            if fallback is not None:
                frontier.add(fallback)
                self._sessions_of(fallback).add(session)

    def _frontier(self, session: str) -> set[UnifiedTreeNode]:
        if session not in self.frontiers:
            self.frontiers[session] = set(self.full._session_leaves.get(session, ()))
        return self.frontiers[session]

    def _sessions_of(self, node: UnifiedTreeNode) -> set[str]:
        if node not in self.held:
            self.held[node] = set(node.component_data[_FULL].session_ids or ())
        return self.held[node]
