"""``tests.mrv2.engine`` for ``eagle3_tree`` engines on MRV2: the same run, plus the
tree runner's counters (``TreeSteps.counters``) and, for the negative control, the
accepted path's commit switched off (``"skip_commit": true``), in this one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the worker is here); ``"linear_positions": true``
leaves the tree rows' rotary positions linear instead.

    python -m tests.mrv2.tree_engine SPEC.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time

from tests.mrv2.engine import install_interpreter_backend, runner_class


def tree_counters(worker) -> dict:
    steps = getattr(worker.model_runner, "tree_steps", None)
    return {} if steps is None else dict(steps.counters)


def skip_commit(worker) -> bool:
    """The negative control: each step's acceptance is dropped instead of committed."""
    steps = worker.model_runner.tree_steps

    def dropped(*_args) -> None:
        steps.step = steps.acceptance = None

    steps.commit = dropped
    return True


def linear_positions(worker) -> bool:
    """The other negative control: the tree rows keep their linear rotary positions
    (the model state's own ``prepare_inputs``, not the tree wrapper's)."""
    state = worker.model_runner.model_state
    state.prepare_inputs = state._inner.prepare_inputs
    return True


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["runner"] == "v2":
        install_interpreter_backend()
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(**spec["engine"])
    runner = llm.collective_rpc(runner_class)[0]
    if spec.get("skip_commit"):
        llm.collective_rpc(skip_commit)
    if spec.get("linear_positions"):
        llm.collective_rpc(linear_positions)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    t0 = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(**spec["sampling"]), use_tqdm=False)
    seconds = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump({"outputs": [list(r.outputs[0].token_ids) for r in results],
                   "seconds": seconds, "counters": llm.collective_rpc(tree_counters)[0],
                   **runner}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
