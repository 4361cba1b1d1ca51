"""Memory layer: page backends (CUDA driver VMM or host memfd pages) and the paged regions built on them.

Imports torch only; the CUDA bindings are imported lazily by the CUDA backend, SGLang never.
"""

from vamp_sglang.memory.backend import (
    BACKEND_NAMES,
    BackendUnavailableError,
    LiveCounts,
    PageBackend,
    PageHandle,
    VmmRuleError,
)
from vamp_sglang.memory.backend_choice import register_backend, select_backend
from vamp_sglang.memory.region import PagedRegion, bytes_checksum

__all__ = [
    "BACKEND_NAMES",
    "BackendUnavailableError",
    "LiveCounts",
    "PageBackend",
    "PageHandle",
    "PagedRegion",
    "VmmRuleError",
    "bytes_checksum",
    "register_backend",
    "select_backend",
]
