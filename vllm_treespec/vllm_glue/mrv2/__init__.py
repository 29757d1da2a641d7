"""``eagle3_tree`` on vLLM's Model Runner V2 (MRV2): the first slice of docs/mrv2.md.

Selected only where vLLM runs MRV2 (``VLLM_USE_V2_MODEL_RUNNER=1`` on 0.32.0, see
``workers.TreeCPUWorker``), on the CPU, for fixed trees (``"adaptive": false``,
no copy branches, sequential drafting: ``checks.check_mrv2_tree``). Per step:

* ``speculator.TreeEagleSpeculator``: first the previous step's accepted path is
  committed (``steps.TreeSteps.commit``: KV of every layer, input ids, hidden and aux
  hidden states moved to the front), then vLLM's own drafting (``_prefill`` and the
  one-query-per-request decode steps) runs ``depth`` levels along the drafter's best
  path; each level's top-k adds siblings (``shapes.chain_with_siblings``). The tree
  goes to MRV2 as ``[num_reqs, num_nodes]`` draft tokens in BFS order.
* ``model_state.TreeModelState`` (wraps the target's ``ModelState``): the step's trees
  (``steps.make_verify_step``), rotary positions ``prefix + depth`` through
  ``prepare_inputs`` (slots stay linear), the tree rows (``TreeVerifyRows``) on the
  target layers' attention metadata through ``prepare_attn``.
* ``sampler.TreeRejectionSampler``: vLLM's rejection sampler for the rows without a
  tree, ``engine.accept`` for the trees; the accepted path + bonus as a chain's output.

Drafting limitation of this slice: the deeper levels expand the best path only (one
query per request, vLLM's decode steps), so a tree is one chain plus siblings at each
depth, not the frontier-wide tree the V1 proposer grows (``draft_levels``).
"""
