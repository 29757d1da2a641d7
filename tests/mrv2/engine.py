"""Run one in-process vLLM engine on Model Runner V2 (MRV2) or V1, on the CPU, and dump
what it generated and which runner ran.

    python -m tests.mrv2.engine SPEC.json OUT.json

SPEC: {"engine": {LLM kwargs}, "prompts": [[token ids]...], "sampling": {...},
       "runner": "v2" | "v1", "interpreter_backend": bool (v2: register the Triton stub;
       false only in the control that shows vLLM refusing MRV2 without it)}
OUT:  {"outputs": [[token ids]...], "runner": "module.Class", "runner_mro": [classes],
       "plugin_registered": bool, "seconds": float (generate only)}

vLLM 0.32.0's MRV2 needs Triton, and Triton from the registry has no CPU backend. Under
Triton's interpreter (``TRITON_INTERPRET=1``) its kernels run as numpy on the CPU; what
vLLM lacks is a driver it counts as active, checked once when ``vllm.triton_utils`` is
first imported. ``runner: v2`` registers one before anything imports vLLM, which is why
each engine gets a fresh process (``harness.run_engine`` sets the environment). The stub
is never called to launch anything: the interpreter does not ask the driver.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace


class _InterpreterDriver:
    """What vLLM asks of Triton's driver: that one is active."""

    @staticmethod
    def is_active() -> bool:
        return True


def install_interpreter_backend() -> None:
    """Make vLLM's Triton check (``vllm.triton_utils.importing``) pass on a CPU. Must run
    before vLLM is imported; refuses to run after, where it would silently do nothing."""
    if "vllm" in sys.modules:
        raise RuntimeError("the Triton backend stub must be installed before vLLM is imported")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("MRV2 on the CPU runs only under Triton's interpreter "
                           "(TRITON_INTERPRET=1)")
    import triton.backends

    triton.backends.backends.setdefault("cpu", SimpleNamespace(driver=_InterpreterDriver))


def torch_top_k_top_p() -> None:
    """vLLM's Triton top-k / top-p kernel fails under the interpreter (a program id
    it calls ``.to`` on is a Python int there), so MRV2 engines here take vLLM's own
    torch path for it, as vLLM does without Triton: plain and tree engines alike
    (the tree's seeded draws call the same ``apply_top_k_top_p``)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False


def runner_class(worker) -> dict:
    """On the worker (``collective_rpc``): the model runner's class and its bases, and
    whether vLLM loaded our plugin there (it does wherever the package is installed)."""
    cls = type(worker.model_runner)
    plugin = sys.modules.get("vllm_treespec")
    return {"runner": f"{cls.__module__}.{cls.__qualname__}",
            "runner_mro": [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__],
            "plugin_registered": bool(plugin and plugin._registered)}


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["runner"] == "v2" and spec.get("interpreter_backend", True):
        install_interpreter_backend()
    from vllm import LLM, SamplingParams, TokensPrompt

    if spec["runner"] == "v2":
        torch_top_k_top_p()
    llm = LLM(**spec["engine"])
    runner = llm.collective_rpc(runner_class)[0]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    t0 = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(**spec["sampling"]), use_tqdm=False)
    seconds = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump({"outputs": [list(r.outputs[0].token_ids) for r in results],
                   "seconds": seconds, **runner}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
