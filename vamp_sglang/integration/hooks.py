"""The one table of every change we make to SGLang at run time.

Each integration module declares its hooks as `Hook` records; `plugin.register()` hands them all to
SGLang's own `HookRegistry` (which patches the targets after every plugin ran), and
`verify_applied()` raises if SGLang could not patch one: SGLang only logs such failures, and a
VAMP server silently running without its decision hook would be worse than one that refuses to
start. `patches/README.md` lists the same targets; a test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"  # the version every hook below was written against


class HookNotApplied(RuntimeError):
    pass


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path inside sglang, e.g. "sglang.srt.managers.scheduler.Scheduler.run_batch"
    kind: str  # "before" | "after" | "around" | "replace" (SGLang's HookType values)
    fn: Callable
    why: str  # one line for patches/README.md


def register_all(hooks: Iterable[Hook]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in hooks:
        HookRegistry.register(hook.target, hook.fn, HookType(hook.kind))


def verify_applied(hooks: Iterable[Hook]) -> None:
    """Raise unless SGLang's registry patched every target (call once the registry has run)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = sorted({h.target for h in hooks} - HookRegistry._patched)
    if missing:
        raise HookNotApplied(
            f"vamp: SGLang did not apply hooks to {missing}; this vamp-sglang was written for "
            f"sglang=={SGLANG_VERSION} (see patches/README.md)"
        )
