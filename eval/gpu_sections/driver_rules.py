"""gpu_check section `driver` (GPU only): what the driver itself enforces, bypassing our bookkeeping (a map
over mapped VA, one unmap over two mappings, a partial unmap)."""

from __future__ import annotations

from collections.abc import Callable

from vamp_sglang.memory.backend import PageBackend


def check(backend: PageBackend, gpu: bool) -> dict:
    """Call the raw primitives (driver calls, no bookkeeping) on rule-breaking inputs; record what happens."""
    g = backend.granularity_bytes
    base = backend.reserve(2 * g)
    h1, h2, h_double = backend.create(g), backend.create(g), backend.create(2 * g)
    result = {}
    backend._map_raw(base, h1)
    result["map_over_mapped_va"] = _attempt(lambda: backend._map_raw(base, h2), undo=lambda: None)
    backend._map_raw(base + g, h2)
    result["unmap_two_adjacent_mappings_in_one_call"] = _attempt(
        lambda: backend._unmap_raw(base, 2 * g),
        undo=lambda: (backend._unmap_raw(base, g), backend._unmap_raw(base + g, g)))
    backend._map_raw(base, h_double)
    result["unmap_sub_range_of_one_mapping"] = _attempt(
        lambda: backend._unmap_raw(base, g), undo=lambda: backend._unmap_raw(base, 2 * g))
    if result["unmap_sub_range_of_one_mapping"] == "accepted":
        backend._unmap_raw(base + g, g)
    backend.free_reservation(base, 2 * g)
    for h in (h1, h2, h_double):
        backend.release(h)
    return result  # a probe: it reports what the driver does and fails only if a call raises unexpectedly


def _attempt(call: Callable[[], None], undo: Callable[[], object]) -> str:
    """'refused: <error>' when the driver rejects the call (then `undo` cleans up), else 'accepted'."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - recording the driver's answer is the point
        undo()
        return f"refused: {exc}"
    return "accepted"
