"""gpu_check section `remap`: create / map (access set once per run) / unmap / remap / release of 1 GiB of
pages (64 MiB on host pages): ms per GiB and GiB/s, the data checked after the move."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.region import PagedRegion

MIB, GIB = 1 << 20, 1 << 30


def check(backend: PageBackend, gpu: bool) -> dict:
    """Create, map, unmap, remap elsewhere and release pages; times per GiB, data checked after the move."""
    g = backend.granularity_bytes
    nbytes, reps = (GIB, 3) if gpu else (64 * MIB, 1)
    n_pages = nbytes // g
    per_gib = GIB / (n_pages * g)
    rows: dict[str, list[float]] = {k: [] for k in ("create", "map", "unmap", "remap_map", "regrow", "release")}
    data_ok = True
    for rep in range(reps):
        src, dst = PagedRegion(backend, n_pages * g), PagedRegion(backend, n_pages * g)
        lap = _timer(backend)
        handles = [backend.create(g) for _ in range(n_pages)]
        rows["create"].append(lap())
        src.extend(handles)  # one run: access set once
        rows["map"].append(lap())
        src.view(torch.uint8, (n_pages * g,)).fill_(rep + 1)
        view = dst.view(torch.uint8, (0,))
        backend.synchronize()
        lap = _timer(backend)
        moved = [src.pop_tail() for _ in range(n_pages)]
        rows["unmap"].append(lap())
        dst.extend(moved[::-1])
        rows["remap_map"].append(lap())
        dst.regrow(view, (n_pages * g,))
        rows["regrow"].append(lap())
        data_ok &= bool((view == rep + 1).all())
        src.close()
        dst.close()
        lap = _timer(backend)
        for h in handles:
            backend.release(h)
        rows["release"].append(lap())
    result = {f"{k}_ms_per_gib": round(statistics.median(v) * 1e3 * per_gib, 3) for k, v in rows.items()}
    result["remap_ms_per_gib"] = round(result["unmap_ms_per_gib"] + result["remap_map_ms_per_gib"], 3)
    result["remap_gib_per_s"] = round(1e3 / result["remap_ms_per_gib"], 2) if result["remap_ms_per_gib"] else None
    result.update(pages=n_pages, page_bytes=g, reps=reps, data_survived_remap=data_ok, ok=data_ok)
    return result


def _timer(backend: PageBackend) -> Callable[[], float]:
    """Returns a callable giving seconds since the last call, after synchronizing the device."""
    last = [time.perf_counter()]

    def lap() -> float:
        backend.synchronize()
        now = time.perf_counter()
        elapsed, last[0] = now - last[0], now
        return elapsed

    return lap
