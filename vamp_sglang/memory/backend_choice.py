"""Which page backend serves a device: a registry of names ("host", "cuda") to factories.

The base module (backend.py) knows no implementation; this one imports each lazily inside its factory,
so importing the memory layer never imports the CUDA bindings, and no module imports in a circle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vamp_sglang.memory.backend import BackendUnavailableError, PageBackend

BackendFactory = Callable[..., PageBackend]
_FACTORIES: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `select_backend(name, ...)` call `factory(device, **options)`."""
    if not name or name == "auto":
        raise ValueError(f"page backend name must be non-empty and not 'auto' (got {name!r})")
    _FACTORIES[name] = factory


def select_backend(name: str, device: torch.device | str, **options: Any) -> PageBackend:
    """Build the page backend `name` ("auto", "cuda", "host") for `device`.

    "auto" picks host pages for a CPU device and the CUDA driver for a CUDA device; it never falls back
    from a CUDA device to host pages, because the model's tensors would then live on the wrong device.
    A machine without a driver raises BackendUnavailableError with the reason."""
    device = torch.device(device)
    if name == "auto":
        if device.type not in ("cpu", "cuda"):
            raise BackendUnavailableError(f"page_backend='auto': no page backend for device type {device.type!r}")
        name = "host" if device.type == "cpu" else "cuda"
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"page_backend must be one of {', '.join(('auto', *_FACTORIES))} (got {name!r})")
    return factory(device, **options)


def _host_factory(device: torch.device, **options: Any) -> PageBackend:
    from vamp_sglang.memory.host_backend import HostPageBackend

    return HostPageBackend(device, **options)


def _cuda_factory(device: torch.device, **options: Any) -> PageBackend:
    from vamp_sglang.memory.cuda_backend import CudaPageBackend

    return CudaPageBackend(device, **options)


register_backend("host", _host_factory)
register_backend("cuda", _cuda_factory)
