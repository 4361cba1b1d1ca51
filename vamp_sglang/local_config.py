"""The `config.json` of a local checkpoint, read before SGLang loads anything.

The launcher decides a few things from the model alone (a hybrid model's CPU flags, a DSA model's
refusal, a quantised checkpoint's dtype). A hub name has no local config.json: it reads as `{}`, and
SGLang decides as it would without us.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def local_model_config(model_path: str | None) -> dict[str, Any]:
    """`model_path/config.json` as a dict, or {} when model_path is not a local checkpoint."""
    config_path = Path(model_path) / "config.json" if model_path else None
    if config_path is None or not config_path.is_file():
        return {}
    return json.loads(config_path.read_text())
