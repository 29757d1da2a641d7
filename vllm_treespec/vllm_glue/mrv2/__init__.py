"""``eagle3_tree`` on vLLM's Model Runner V2 (MRV2): the first slice of docs/mrv2.md.

Selected only where vLLM runs MRV2 (``VLLM_USE_V2_MODEL_RUNNER=1`` on 0.32.0, see
``workers.TreeCPUWorker``), on the CPU, for fixed trees (``"adaptive": false``,
no copy branches, sequential drafting: ``checks.check_mrv2_tree``). Per step:

* ``speculator.TreeEagleSpeculator``: first the previous step's accepted path is
  committed (``steps.TreeSteps.commit``: KV of every layer, input ids, hidden and aux
  hidden states moved to the front), then vLLM's first drafting pass alone
  (``_prefill``); a dynamic tree grows from its roots' log-probabilities through the
  engine's level loop (``trees.grow_trees``: ``engine.levels.grow_levels`` with the
  drafter's frontier forwarded a level at a time, ``TreeLevels``), as on V1. The tree
  goes to MRV2 as ``[num_reqs, num_nodes]`` draft tokens in BFS order.
* ``model_state.TreeModelState`` (wraps the target's ``ModelState``): the step's trees
  (``steps.make_verify_step``), rotary positions ``prefix + depth`` through
  ``prepare_inputs`` (slots stay linear), the tree rows (``TreeVerifyRows``) on the
  target layers' attention metadata through ``prepare_attn``.
* ``sampler.TreeRejectionSampler``: vLLM's rejection sampler for the rows without a
  tree, ``engine.accept`` for the trees (greedy; lossless at T > 0; seeded requests
  with MRV2's own Gumbel draws, ``seeded``); the accepted path + bonus as a chain's
  output.
* ``requests``: the request parameters tree acceptance does not reproduce on MRV2,
  refused by name at the frontend (a 400), installed by ``checks.check_mrv2_tree``.
* ``registration``, ``method_config``: where vLLM has ``register_speculative_method``
  (0.34+), ``eagle3_tree`` is registered there with an EAGLE-3 config subclass naming
  ``speculator.RegisteredTreeSpeculator``, which the runner adopts (docs/mrv2.md,
  section 8; never run on 0.34).
"""
