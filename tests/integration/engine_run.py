"""Run one vLLM engine configuration in its own process and dump the results.

    python -m tests.integration.engine_run SPEC.json OUT.json

SPEC: {"engine": {LLM kwargs}, "prompts": [[token ids]...], "sampling": {...},
       "sampling_per_prompt": [{...}] | null, "max_tokens_per_prompt": [int] | null,
       "batch": "all" | 1, "oracle": {"reference": {...}, "seed": int, "mode": str,
       "max_children": int (trie mode, optional)} | null
       (mode "marginals": parallel_oracle, otherwise oracle.install's modes),
       "n_per_prompt": int, "schedule": {"off_steps", "period", "mode", "chain"?} | null,
       "draft_faults": N | null (every N-th drafter forward raises),
       "stream_seeded_plain_steps": bool (negative control of seeded reproduction),
       "break_stochastic" / "drop_sibling_renormalisation": bool (biased acceptance
       rules, negative controls of the T>0 test),
       "record_proposals": bool (stock or tree drafter),
       "record_drafter_work": bool (per drafting step: rows that may get a tree, drafter
       forwards and their tokens, drafts per row, rows the levels grew and caught up),
       "slow_rank": {"rank", "factor"} | null (that tensor-parallel rank's clock runs
       factor times slow; every rank records its planned depths),
       "record_plans": bool (the adaptive budget's decisions, rank 0's),
       "shift_grammar_masks": bool (negative control: each tree node's logits row
                               masked with the next node's grammar mask),
       "scheduler_pads_drafts": bool (vLLM's -1 placeholder padding of joining
                                 requests restored: scheduling.disable_draft_padding undone),
       "chunk_faults": {"control_pad_locals": int} | null (page faults inside the
       runner's fresh-chunk entries, see oracle.count_chunk_faults)}
OUT:  {"outputs": [[token ids]...] (per prompt, per sample), "tree": metrics | null,
       "drafts": {"prompt hash@root position": first draft token} | null (with "schedule"),
       "proposals": {"prompt hash@root position": [draft tokens]} | null,
       "drafter_work": [{"allowed", "forwards", "tokens", "drafts", "level_rows",
                         "caught_up_rows"} per drafting step] | null (with "record_drafter_work"),
       "planned_depths": [[depth per drafting step] per rank] | null (with "slow_rank"),
       "plans": [[batch, planned depth, probe, decision inputs] per drafting step] | null
                (with "record_plans"; inputs: budget_hooks.decision_inputs, null when off),
       "chunk_faults": {"shipped"|"control": [faults per execute_model]} | null,
       "seconds": float, "preemptions": int, "prefix_cache_hits": int,
       "scheduler": {"lookahead": KV slots reserved past scheduled tokens,
                     "pads_drafts": whether joining requests get placeholder drafts},
       "spec_decode": {"draft_tokens": int, "accepted_per_pos": [int] | null}}

Each engine runs in a fresh process so tests never share vLLM global state.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    from tests.integration import budget_hooks, oracle, parallel_oracle

    spec = json.loads(open(spec_path).read())
    llm = LLM(**dict(spec["engine"], disable_log_stats=False))
    tree_mode = (spec["engine"].get("speculative_config") or {}).get("method") == "eagle3_tree"
    if spec.get("oracle") and tree_mode:
        o = spec["oracle"]
        install = parallel_oracle.install if o.get("mode") == "marginals" else oracle.install
        llm.collective_rpc(install, args=(o["reference"], o.get("seed", 0)),
                           kwargs={"mode": o.get("mode", "greedy"),
                                   **({"max_children": o["max_children"]}
                                      if "max_children" in o else {})})
    if spec.get("schedule") and tree_mode:
        sch = spec["schedule"]
        llm.collective_rpc(oracle.schedule_speculation,
                           args=(sch["off_steps"], sch["period"], sch["mode"],
                                 sch.get("chain", False)))
    if spec.get("break_stochastic") and tree_mode:
        llm.collective_rpc(oracle.break_stochastic_acceptance)
    if spec.get("drop_sibling_renormalisation") and tree_mode:
        llm.collective_rpc(oracle.drop_sibling_renormalisation)
    if spec.get("stream_seeded_plain_steps") and tree_mode:
        llm.collective_rpc(oracle.stream_seeded_plain_steps)
    if spec.get("record_proposals"):
        llm.collective_rpc(oracle.record_proposals)
    if spec.get("record_drafter_work") and tree_mode:
        llm.collective_rpc(oracle.record_drafter_work)
    if spec.get("draft_faults") and tree_mode:
        llm.collective_rpc(oracle.inject_draft_faults, args=(spec["draft_faults"],))
    if spec.get("chunk_faults") is not None and tree_mode:
        llm.collective_rpc(oracle.count_chunk_faults,
                           args=(spec["chunk_faults"]["control_pad_locals"],))
    if spec.get("slow_rank") and tree_mode:
        llm.collective_rpc(budget_hooks.slow_clock, args=(spec["slow_rank"]["rank"],
                                                          spec["slow_rank"]["factor"]))
    elif spec.get("record_plans") and tree_mode:
        llm.collective_rpc(budget_hooks.record_plans)
    if spec.get("vllm_zero_drafts") and tree_mode:
        llm.collective_rpc(oracle.restore_vllm_zero_drafts)
    if spec.get("shift_grammar_masks") and tree_mode:
        oracle.shift_grammar_masks(llm.llm_engine.engine_core.engine_core.scheduler)
    if spec.get("scheduler_pads_drafts") and tree_mode:
        # The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
        llm.llm_engine.engine_core.engine_core.scheduler.dynamic_sd_lookup = None
    def params(kwargs: dict) -> SamplingParams:  # structured output as JSON: a dict
        if isinstance(kwargs.get("structured_outputs"), dict):
            from vllm.sampling_params import StructuredOutputsParams

            kwargs = dict(kwargs, structured_outputs=StructuredOutputsParams(
                **kwargs["structured_outputs"]))
        return SamplingParams(**kwargs)

    sampling = params(spec["sampling"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    if spec.get("max_tokens_per_prompt"):  # requests finishing at different steps
        sampling = [params(dict(spec["sampling"], max_tokens=m))
                    for m in spec["max_tokens_per_prompt"]]
    if spec.get("sampling_per_prompt"):
        sampling = [params(dict(spec["sampling"], **s))
                    for s in spec["sampling_per_prompt"]]
    t0 = time.perf_counter()
    results = []
    if spec.get("batch", "all") == 1:
        for i, p in enumerate(prompts):
            sp = sampling[i] if isinstance(sampling, list) else sampling
            results += llm.generate([p], sp, use_tqdm=False)
    else:
        results = llm.generate(prompts, sampling, use_tqdm=False)
    seconds = time.perf_counter() - t0
    outputs = [[list(c.token_ids) for c in r.outputs] for r in results]
    tree = llm.collective_rpc(oracle.tree_metrics)[0] if tree_mode else None
    if tree and tree["draft_faults"] and not spec.get("draft_faults"):
        # the proposer survives a drafting fault; the tests must still see it
        raise RuntimeError(f"{tree['draft_faults']} drafting step(s) raised; see the log")
    drafts = (llm.collective_rpc(oracle.recorded_drafts)[0]
              if spec.get("schedule") and tree_mode else None)
    proposals = (llm.collective_rpc(oracle.recorded_proposals)[0]
                 if spec.get("record_proposals") else None)
    drafter_work = (llm.collective_rpc(oracle.recorded_drafter_work)[0]
                    if spec.get("record_drafter_work") and tree_mode else None)
    chunk_faults = (llm.collective_rpc(oracle.chunk_faults)[0]
                    if spec.get("chunk_faults") is not None and tree_mode else None)
    plans = (llm.collective_rpc(budget_hooks.recorded_plans)
             if (spec.get("slow_rank") or spec.get("record_plans")) and tree_mode else None)
    planned = [[d for _, d, *_ in p] for p in plans] if plans and spec.get("slow_rank") else None
    metrics = llm.get_metrics()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core

    def counter(name: str) -> float:
        return sum(getattr(m, "value", 0) for m in metrics if m.name == name)

    def vector(name: str) -> list[int] | None:
        return next((list(m.values) for m in metrics if m.name == name), None)

    with open(out_path, "w") as f:
        json.dump({"outputs": outputs, "tree": tree, "seconds": seconds, "drafts": drafts,
                   "proposals": proposals, "chunk_faults": chunk_faults,
                   "drafter_work": drafter_work,
                   "planned_depths": planned,
                   "plans": plans[0] if plans and spec.get("record_plans") else None,
                   "preemptions": counter("vllm:num_preemptions"),
                   "scheduler": {"lookahead": scheduler.num_lookahead_tokens,
                                 "pads_drafts": scheduler.dynamic_sd_lookup is None},
                   "prefix_cache_hits": counter("vllm:prefix_cache_hits"),
                   "spec_decode": {
                       "draft_tokens": counter("vllm:spec_decode_num_draft_tokens"),
                       "accepted_per_pos": vector(
                           "vllm:spec_decode_num_accepted_tokens_per_pos")}}, f)


def run_forked(spec_path: str, out_path: str, log_path: str, env: dict, cwd: str) -> None:
    """``main`` in a fork of conftest's engine server: the test's environment and working
    directory, stdout and stderr into ``log_path``."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        main(spec_path, out_path)
    finally:
        atexit._run_exitfuncs()  # a fork ends in os._exit: vLLM's shutdown hooks run here


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
