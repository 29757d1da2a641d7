"""vllm-treespec: dynamic EAGLE-3 tree speculative decoding for stock vLLM.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every
process (API server, engine core, workers); it must be idempotent, cheap, and
harmless when vLLM is absent or no tree method is configured.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    try:
        import vllm  # noqa: F401
    except ImportError:  # the tree core works without vLLM
        return
    from vllm_treespec.vllm_glue import install

    install()
