"""HiCache (`--enable-hierarchical-cache`) configurations the launcher refuses or completes, before anything loads.

With VAMP on, HiCache's host tier is one more place an evicted prefix can live (docs/hicache.md). VAMP serves
the host pool HiCache builds over the device pool it grows (`MHATokenToKVPoolHost`, write-through or
write-back), and refuses:
- `--hicache-storage-backend` (an L3 tier: its prefetch and write-back threads keep device indices VAMP's
  compaction would have to follow, and its bytes are not in the host-memory budget);
- HiCache on a hybrid linear-attention model (Qwen3-Next: its state pool has a host pool of its own VAMP does
  not account for);
- `--page-size` > 1 (compaction moves token rows; HiCache pages would have to move whole);
- a speculative draft with a KV pool (`--speculative-algorithm` EAGLE, EAGLE3, NEXTN): SGLang 0.5.23 gives the
  draft's KV a host copy of its own, the MTP layers packed into the target's host pool (PACKED,
  speculative/base_spec_worker.py:303-329) or the draft pool as a HiCache sidecar with its own host pool
  (SIDECAR, :336-341, mem_cache/kv_cache_builder.py:122-157). VAMP's host-memory budget and load pricing
  (integration/cache/hicache_tier.py) read the target's host pool only, and no VAMP run has loaded a
  prefix back with its draft rows.
On CPU (any VAMP setting) HiCache runs only through the `direct` io backend, whose copies vamp_sglang/cpu/hicache.py
answers in torch: `kernel` (SGLang's default) is refused when given, and `direct` is added when not.
No SGLang import here: the launcher answers in a second.
"""

from __future__ import annotations

import argparse

HICACHE = "--enable-hierarchical-cache"
DIRECT = "direct"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The SGLang flags `refused` reads, for the launcher's SGLang-free view of the argv."""
    parser.add_argument("--hicache-storage-backend", default=None)
    parser.add_argument("--hicache-io-backend", default=None)
    parser.add_argument("--page-size", type=int, default=None)


def refused(sg: argparse.Namespace, vamp_on: bool, hybrid: bool, draft: bool = False) -> str | None:
    """The refusal, naming the flag, of a HiCache configuration this launcher cannot serve; or None. `draft`:
    the flags build a speculative draft with a KV pool (the launcher's reading of --speculative-algorithm)."""
    if not getattr(sg, "enable_hierarchical_cache", False):
        return None
    if (sg.device or "cuda") == "cpu" and sg.hicache_io_backend not in (None, DIRECT):
        return (f"--hicache-io-backend {sg.hicache_io_backend} is not supported on --device cpu (its pointer-table "
                f"ops are CUDA-only); use --hicache-io-backend direct")
    if not vamp_on:
        return None
    suffix = "is not supported with --enable-hierarchical-cache and --vamp-max-offload-ratio > 0"
    if sg.hicache_storage_backend:
        return f"--hicache-storage-backend {suffix} (VAMP prices the host tier only; run HiCache without storage)"
    if sg.page_size not in (None, 1):
        return f"--page-size {sg.page_size} {suffix} (compaction moves token rows: page size 1 only)"
    if hybrid:
        return f"{HICACHE} is not supported with --vamp-max-offload-ratio > 0 on a hybrid linear-attention model"
    if draft:
        return (f"{HICACHE} with --speculative-algorithm {sg.speculative_algorithm} is not supported with "
                f"--vamp-max-offload-ratio > 0 (SGLang gives the draft's KV its own host copy, packed MTP layers or "
                f"a sidecar host pool, which VAMP's host-memory budget and load pricing do not count); drop one")
    return None


def cpu_defaults(sg: argparse.Namespace) -> list[str]:
    """Flags CPU mode adds to a HiCache launch the user did not give."""
    return ["--hicache-io-backend", DIRECT] if getattr(sg, "enable_hierarchical_cache", False) else []
