"""patches/ is the list of everything we change in SGLang; these tests keep it true.

Each hook target must still exist in the installed SGLang, the README table must list exactly the
hooks the code registers, and every unified diff under patches/ must apply cleanly.
"""

import pathlib
import pkgutil
import re
import subprocess

import sglang

from vamp_sglang.cpu import fp8, hicache, mla, parallel, speculative, triton_free
from vamp_sglang.integration import plugin
from vamp_sglang.integration.hooks import SGLANG_VERSION

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "patches" / "README.md"
CPU_HOOKS = (triton_free.HOOKS + fp8.HOOKS + mla.HOOKS + hicache.HOOKS + parallel.HOOKS
             + speculative.HOOKS)
ROW = re.compile(r"^\|\s*`(sglang\.[\w.]+)`\s*\|\s*(\w+)\s*\|(.+)\|\s*([\d.]+)\s*\|\s*$")


def _readme_rows():
    return [ROW.match(line).groups() for line in README.read_text().splitlines() if ROW.match(line)]


def test_installed_sglang_is_the_pinned_version():
    assert sglang.__version__ == SGLANG_VERSION


def test_every_hook_target_exists_in_installed_sglang():
    for hook in plugin.all_hooks() + CPU_HOOKS:
        assert pkgutil.resolve_name(hook.target) is not None, hook.target


def test_readme_lists_exactly_the_registered_hooks():
    rows = {(target, kind) for target, kind, _why, _version in _readme_rows()}
    code = {(h.target, h.kind) for h in plugin.all_hooks() + CPU_HOOKS}
    assert rows == code, f"patches/README.md out of step: only in README {rows - code}, only in code {code - rows}"


def test_readme_targets_written_for_pinned_version():
    assert {version for *_, version in _readme_rows()} == {SGLANG_VERSION}


def test_every_diff_is_listed_and_applies_cleanly_to_pinned_sglang():
    site = pathlib.Path(sglang.__file__).resolve().parents[1]
    for diff in sorted((ROOT / "patches").glob("*.diff")):
        assert diff.name in README.read_text(), f"{diff.name} is not described in patches/README.md"
        proc = subprocess.run(["patch", "--dry-run", "-p1", "-d", str(site), "-i", str(diff)],
                              check=False, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
