"""The tree engine: one verify step's state and what is done to it, free of vLLM.

A runner adapter (``vllm_glue`` for vLLM's V1 model runner) translates its
runner's hooks into these calls and nothing more:

* ``step.VerifyStep``: the trees of one step, their roots, positions and logits
  rows, passed from the layout to acceptance to the commit;
* ``layout``: the tree rows' rotary positions and the attention rows every
  backend reads (``TreeVerifyRows``);
* ``accept``: the target's distribution at the nodes (``NodeLogits``) under
  each request's sampling parameters (``TreeSampling``), and the acceptance
  rule: greedy, lossless stochastic, seeded;
* ``commit``: the accepted path moved to the front of its slots.

Nothing here imports vLLM (``tests/unit/test_engine.py`` checks it): what a
runner must supply comes in as tensors and callables.
"""
