"""The checkout's root imports only names that are ours.

Python puts the working directory first on sys.path (``python -m pytest``, ``python -c``,
an engine started from the checkout), so a regular package at the root shadows any
installed distribution of the same name. Our Triton kernels once lived in a root
``kernels/`` package: transformers 5.25 depends on the Hugging Face ``kernels``
distribution and imports it while vLLM loads, which then found ours and failed
(``cannot import name 'CUDAProperties' from 'kernels'``) in every engine started here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"vllm_treespec", "tests"}


def root_import_names() -> set[str]:
    """Names `import NAME` resolves to the root: regular packages and modules (a
    directory without ``__init__.py`` is only a namespace portion, which an
    installed package of the same name outranks)."""
    names = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    return names | {p.stem for p in ROOT.glob("*.py")}


def test_the_root_holds_only_our_packages():
    assert root_import_names() <= OURS, (
        f"the repository root makes {sorted(root_import_names() - OURS)} importable from a "
        "checkout; move it under vllm_treespec/")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_transformers_imports_from_the_checkout_root():
    """What every engine started from the checkout does first."""
    subprocess.run([sys.executable, "-c", "import transformers.activations"],
                   cwd=ROOT, check=True, timeout=300)
