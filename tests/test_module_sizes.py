"""Small modules with one job each (issue 24): none in the package over 400 lines, none in eval/ over 500."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("folder, most_lines", [("vamp_sglang", 400), ("eval", 500)])
def test_no_module_outgrows_its_limit(folder, most_lines):
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / folder).rglob("*.py")}
    assert lines, f"no modules found under {folder}/"
    assert {path: n for path, n in lines.items() if n > most_lines} == {}
