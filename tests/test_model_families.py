"""Every MoE architecture SGLang 0.5.23 registers is served by VAMP or refused by name at the launcher
(issue 47).

The MoE architectures are derived from SGLang's own model registry: a registered class is MoE when its
module, or a class or function it reaches through SGLang's model modules, builds SGLang's MoE layer
(`FusedMoE`, `get_moe_impl_class`, `fused_moe`) or assigns an `experts` module. The walk reads source
(ast) instead of building models, which needs weights and a device.
"""

import ast
import json
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

from vamp_sglang import launch_server
from vamp_sglang.config import ConfigError
from vamp_sglang.refusals import families
from vamp_sglang.tiny_moe.checkpoint import DEFAULT_ARCH
from vamp_sglang.tiny_moe.checkpoint import FAMILIES as TINY_FAMILIES

ROOT = Path(__file__).resolve().parents[1]
MODELS = "sglang.srt.models"
MOE_LAYERS = {"FusedMoE", "get_moe_impl_class", "fused_moe"}  # SGLang's MoE layer and its kernel entry


@cache
def _module_names(module: str) -> dict[str, set[tuple[str, str]]]:
    """For each top-level class, function and assignment of an SGLang model module, what it refers to:
    ("moe", name) for an MoE layer or an `experts` attribute it sets, (module, name) for other model code."""
    path = Path(sys.modules[MODELS].__path__[0]) / f"{module}.py"
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text())
    imported, modules = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            source = f"{MODELS}.{node.module}" if node.level == 1 else node.module
            for alias in node.names:
                if source == MODELS:
                    modules[alias.asname or alias.name] = alias.name
                elif source.startswith(MODELS + "."):
                    imported[alias.asname or alias.name] = (source.rsplit(".", 1)[1], alias.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname: a.name.rsplit(".", 1)[1] for a in node.names
                        if a.asname and a.name.startswith(MODELS + ".")}
    top: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            top[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            top |= {t.id: node for t in targets if isinstance(t, ast.Name)}
    refs: dict[str, set[tuple[str, str]]] = {}
    for name, node in top.items():
        found = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in modules:
                found.add((modules[sub.value.id], sub.attr))
            elif isinstance(sub, ast.Attribute) and sub.attr == "experts" and isinstance(sub.ctx, ast.Store):
                found.add(("moe", "experts"))
            elif (word := sub.id if isinstance(sub, ast.Name) else getattr(sub, "attr", None)) is not None:
                if word in MOE_LAYERS:
                    found.add(("moe", word))
                elif word in top and word != name:
                    found.add((module, word))
                elif word in imported:
                    found.add(imported[word])
        refs[name] = found
    return refs


def builds_experts(module: str, name: str, seen: set | None = None) -> bool:
    """Whether `module.name` reaches an MoE layer through SGLang's model code."""
    seen = set() if seen is None else seen
    if (module, name) in seen:
        return False
    seen.add((module, name))
    return any(ref[0] == "moe" or builds_experts(*ref, seen) for ref in _module_names(module).get(name, ()))


@pytest.fixture(scope="module")
def registered() -> dict[str, type]:
    """SGLang's model registry: every architecture name and its class (imports every model module)."""
    from sglang.srt.models.registry import ModelRegistry

    return {arch: ModelRegistry.models[arch] for arch in ModelRegistry.get_supported_archs()}


@pytest.fixture(scope="module")
def moe_archs(registered) -> set[str]:
    return {arch for arch, cls in registered.items()
            if builds_experts(cls.__module__.rsplit(".", 1)[1], cls.__name__)}


def test_the_walk_tells_moe_from_dense(registered, moe_archs):
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM",
            "KimiK25ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"} <= moe_archs
    assert not {"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MiniCPMForCausalLM"} & moe_archs
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(registered)


def test_every_registered_moe_architecture_is_served_or_refused_once(moe_archs):
    listed = [arch for family in families.FAMILIES for arch in family.archs]
    assert sorted(a for a in set(listed) if listed.count(a) > 1) == []
    assert {"missing from families.py": sorted(moe_archs - set(listed)),
            "not an MoE architecture SGLang registers": sorted(set(listed) - moe_archs)} == {
        "missing from families.py": [], "not an MoE architecture SGLang registers": []}


def _server_test_sources() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py")
                     if "pytest.mark.server" in p.read_text())


@pytest.mark.parametrize("family", [f for f in families.FAMILIES if f.served], ids=lambda f: f.name)
def test_a_served_family_has_a_tiny_checkpoint_and_a_server_test(family):
    sources = _server_test_sources()
    for tiny in family.tiny_archs:
        assert TINY_FAMILIES[tiny].architecture in family.archs
        assert tiny == DEFAULT_ARCH or f'"{tiny}"' in sources, f"no server test module names --arch {tiny}"


def _checkpoint(tmp_path: Path, arch: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(tmp_path)


@pytest.mark.parametrize("arch", sorted(a for f in families.FAMILIES if not f.served for a in f.archs))
def test_a_refused_family_is_named_with_its_reason_before_anything_loads(tmp_path, arch):
    family = families.BY_ARCH[arch]
    argv = ["--model-path", _checkpoint(tmp_path, arch), "--device", "cpu"]
    with pytest.raises(ConfigError) as err:
        launch_server.prepare(argv + ["--vamp-max-offload-ratio", "0.2"])
    assert f"{arch} ({family.name})" in str(err.value) and family.reason in str(err.value)
    assert launch_server.prepare(argv + ["--vamp-max-offload-ratio", "0"]).vamp.enabled is False


@pytest.mark.parametrize("arch", [a for f in families.FAMILIES if f.served for a in f.archs])
def test_a_served_family_passes_the_launcher(tmp_path, arch):
    launch = launch_server.prepare(["--model-path", _checkpoint(tmp_path, arch), "--device", "cpu",
                                    "--vamp-max-offload-ratio", "0.2"])
    assert launch.vamp.enabled


def test_a_hub_name_is_left_to_scheduler_start():
    assert families.refused(launch_server._sglang_view(["--model-path", "openai/gpt-oss-120b"])) is None


def test_the_cli_refuses_gpt_oss_within_a_second(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vamp_sglang.launch_server", "--model-path",
                           _checkpoint(tmp_path, "GptOssForCausalLM"), "--device", "cpu",
                           "--vamp-max-offload-ratio", "0.2"],
                          check=False, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2 and "GptOssForCausalLM (gpt-oss)" in proc.stderr and "MXFP4" in proc.stderr
    assert elapsed < 1.5, f"refusal took {elapsed:.2f} s"


def test_readme_model_table_is_the_families_table():
    assert families.markdown_table() in (ROOT / "README.md").read_text()
