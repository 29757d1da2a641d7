"""The only place that imports vLLM internals (targets vLLM 0.27.1).

``install`` is called by the plugin entry point in every vLLM process. It only
wraps the speculative-config translation; everything else is selected through
the engine configuration (the worker class) when the method is ``eagle3_tree``,
so stock methods run untouched.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.27",)


def install() -> None:
    import vllm

    version = getattr(vllm, "__version__", "")
    if not version.startswith(SUPPORTED_VLLM):
        import logging

        logging.getLogger("vllm.treespec").warning(
            "vllm-treespec targets vLLM %s; found %s — eagle3_tree may not work",
            "/".join(SUPPORTED_VLLM), version)
    from vllm_treespec.vllm_glue.spec_config import patch_engine_args

    patch_engine_args()
