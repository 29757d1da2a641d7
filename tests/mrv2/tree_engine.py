"""``tests.mrv2.engine`` for ``eagle3_tree`` engines on MRV2: the same run, plus the
tree runner's counters (``TreeSteps.counters``) and, for the negative control, the
accepted path's commit switched off (``"skip_commit": true``), in this one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the worker is here); ``"linear_positions": true``
leaves the tree rows' rotary positions linear instead. ``"check_chain": true`` also
runs vLLM's own chain drafting after each tree and counts where the tree's greedy path
differs from it (a control of the levels' attention: ``check_chain``).
T > 0 (``test_tree_sampling``): ``"sampling_per_prompt"`` (each prompt's settings over
``"sampling"``), ``"oracle"`` (``tests.mrv2.oracle``'s trie trees), and the V1 tests'
acceptance mutants ``"break_stochastic"`` / ``"drop_sibling_renormalisation"``
(``tests.integration.oracle``: they patch ``engine.accept.stochastic_accept``).
``"refused"``: {name: sampling} requests tried first, one at a time; each one's error
(or its output, if it was served) is reported under ``"refusals"``.

    python -m tests.mrv2.tree_engine SPEC.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time

from tests.mrv2.engine import install_interpreter_backend, runner_class, torch_top_k_top_p


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


def greedy_path(tree) -> list[int]:
    """The tree's path along each node's likeliest child: the drafter's greedy chain
    (a child ranks below its parent, so a kept node's best child is kept first)."""
    path, node = [], 0
    while True:
        kids = [i + 1 for i, p in enumerate(tree.parents) if p == node]
        if not kids:
            return path
        node = max(kids, key=lambda i: tree.probs[i - 1])
        path.append(tree.tokens[node - 1])


def check_chain(worker) -> bool:
    """After each step's tree, vLLM's stock drafting (its first pass again, then its
    one-query decode steps over the paged cache, ``depth`` tokens) must draft the
    tree's greedy path: the levels' side-buffer attention sees what the paged
    kernel does. Its draft KV lands past the new roots, where stock MRV2 writes its
    own and the next step overwrites it; the tree's drafts are what MRV2 verifies."""
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

    spec = worker.model_runner.speculator
    steps = worker.model_runner.tree_steps
    tree_propose = spec.propose

    def propose(input_batch, *args, **kwargs):
        drafts = tree_propose(input_batch, *args, **kwargs)
        if kwargs.get("dummy_run") or kwargs.get("num_speculative_tokens") == 0:
            return drafts
        depth = spec.tree_cfg.depth
        chain = EagleSpeculator.propose(spec, input_batch, *args, **dict(
            kwargs, num_speculative_tokens=depth))[:, :depth].tolist()
        for b, state in enumerate(input_batch.idx_mapping_np[:input_batch.num_reqs].tolist()):
            path = greedy_path(steps.proposed[int(state)])
            steps.counters["chain_checked"] += 1
            steps.counters["chain_level_nodes"] += max(len(path) - 1, 0)  # below the first pass
            steps.counters["chain_mismatch"] += int(path != chain[b][:len(path)])
        return drafts

    spec.propose = propose
    return True


def install_controls(llm, spec: dict) -> None:
    """The spec's oracle and negative controls, on the worker (this process)."""
    from tests.integration import oracle as v1_oracle
    from tests.mrv2 import oracle

    if spec.get("skip_commit"):
        llm.collective_rpc(skip_commit)
    if spec.get("linear_positions"):
        llm.collective_rpc(linear_positions)
    if spec.get("check_chain"):
        llm.collective_rpc(check_chain)
    if spec.get("oracle"):
        llm.collective_rpc(oracle.install, args=(spec["oracle"]["reference"],
                                                 spec["oracle"].get("max_children")))
    if spec.get("break_stochastic"):
        llm.collective_rpc(v1_oracle.break_stochastic_acceptance)
    if spec.get("drop_sibling_renormalisation"):
        llm.collective_rpc(v1_oracle.drop_sibling_renormalisation)


def try_refused(llm, prompt, base: dict, refused: dict) -> dict:
    """Each of ``refused`` ({name: sampling}) as one request: its error, or the tokens
    it was served (a refusal that did not happen)."""
    from vllm import SamplingParams

    report = {}
    for name, sampling in refused.items():
        if "logit_bias" in sampling:  # JSON made its token ids strings
            sampling = dict(sampling, logit_bias={int(k): v for k, v in
                                                  sampling["logit_bias"].items()})
        try:
            r = llm.generate([prompt], SamplingParams(**dict(base, **sampling)), use_tqdm=False)
            report[name] = {"served": list(r[0].outputs[0].token_ids)}
        except Exception as e:  # noqa: BLE001 -- the test reads what was raised
            report[name] = {"error": f"{type(e).__name__}: {e}"}
    return report


def run_batch(llm, batch: dict) -> dict:
    """One ``generate`` of ``batch`` ({"prompts", "sampling", "sampling_per_prompt"}):
    its outputs, seconds, and the tree counters after it."""
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]]
    per_prompt = batch.get("sampling_per_prompt") or [{}] * len(prompts)
    params = [SamplingParams(**dict(batch["sampling"], **s)) for s in per_prompt]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    return {"outputs": [list(r.outputs[0].token_ids) for r in results],
            "seconds": time.perf_counter() - t0,
            "counters": llm.collective_rpc(tree_counters)[0]}


def main(spec_path: str, out_path: str) -> None:
    """The spec's ``"batches"`` one after the other (each reported under its
    ``"name"``), or its ``"prompts"`` as one batch (reported at the top level)."""
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["runner"] == "v2":
        install_interpreter_backend()
    from vllm import LLM, TokensPrompt

    if spec["runner"] == "v2":
        torch_top_k_top_p()
    llm = LLM(**spec["engine"])
    runner = llm.collective_rpc(runner_class)[0]
    install_controls(llm, spec)
    batches = spec.get("batches") or [dict(spec, name=None)]
    first = TokensPrompt(prompt_token_ids=batches[0]["prompts"][0])
    refusals = try_refused(llm, first, batches[0]["sampling"], spec.get("refused", {}))
    out = {"refusals": refusals, **runner}
    for batch in batches:
        result = run_batch(llm, batch)
        if batch["name"] is None:
            out.update(result)
        else:
            out[batch["name"]] = result
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
