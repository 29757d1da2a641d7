"""Tree-verify attention on Ascend NPUs, expressed as torch_npu calls.

Pure torch: this package builds the exact argument tuples of the torch_npu
attention ops and runs them through an ``ops`` namespace that is either the real
``torch_npu`` module or the CPU emulation of its documented contract
(:mod:`vllm_treespec.attention.emulation`). Nothing here imports torch_npu, so it
imports and is tested on any machine; the vLLM-Ascend glue lives in
``vllm_treespec.vllm_glue.ascend``.

The function computed is the reference's (``reference.paged_tree_attention``):
each query token of a request sees the request's committed context ``[0, ctx)``
plus, among the request's own query tokens, exactly those allowed by its
intra-request mask (ancestor-or-self for a draft tree, causal otherwise). The KV
cache is vllm-ascend's: per layer a K and a V tensor ``[blocks, 128, KVH, D]``.

Three ways to express it with torch_npu (from the op docs of
``npu_fused_infer_attention_score`` (FIA), ``npu_fused_infer_attention_score_v2``
and ``npu_attention_update`` in torch_npu's ``_op_plugin_docs.py``; what they do
not cover is marked, see :mod:`.documented`):

* ``full_mask`` (A, default): one FIA call, ``input_layout="BSND"``, queries padded
  to ``T`` per request, ``atten_mask`` int8 ``(B, 1, T, max_blocks*128)`` (1 =
  masked) over the paged KV, ``sparse_mode=0``, ``inner_precise=2``. The mask
  lives in a persistent buffer that stays all-zero except for each request's
  ``T`` tree columns ``[ctx, ctx+T)``; a step rewrites only those windows.
  TND cannot carry a user mask (TND allows only sparse 0 without a mask or
  sparse 3 with the compressed causal mask), hence BSND.
* ``two_pass`` (B): prefix attention without a mask (TND, KV length ``ctx``,
  ``softmax_lse_flag=True``) plus dense attention among the ``T`` tree tokens
  (BSND over the step's own K/V, mask ``(B, 1, T, T)``), merged through their
  log-sum-exps by ``npu_attention_update``. Its mask does not grow with context.
  TND without rope is documented for head size 128/192 and bfloat16 only: other
  heads or dtypes are refused at startup.
* ``tree_sparse`` (C): one FIA v2 call with ``sparse_mode=9`` ("treeMask": per
  request a ``q x q`` mask over the last ``q`` KV positions, TND flat layout
  ``(sum q_i^2,)``). Not documented: v2's docs list sparse modes 0-4, v1's give
  mode 9 for MLA only (with ``query_rope``/``key_rope``), and no doc gives this
  mask layout. The backend enables it only within TND's documented head sizes
  and dtype and after
  :func:`~vllm_treespec.attention.ascend.synthetic.probe_tree_sparse` agreed with
  ``full_mask`` on the live device; otherwise it uses ``full_mask``.

A fourth variant is not a torch_npu call: ``triton`` (D) launches our own Triton
kernel (:mod:`vllm_treespec.kernels.tree_attention`, compiled for the NPU by
triton-ascend): one pass over the paged KV with the tree as a per-row ancestor
bitmask, no context-sized mask and no merge. Eager only (refused with
``$VLLM_TREESPEC_ASCEND_FULL_GRAPH=1``). Checked here under Triton's CPU
interpreter; not yet run on an NPU.

Modules, in dependency order (each imports only modules above it):

* :mod:`.constants`: block size and variant names;
* :mod:`.documented`: what torch_npu's docs cover for the variants' TND calls;
* :mod:`.plans`: :class:`TreeAttentionPlan` of a verify step;
* :mod:`.buffers`: :class:`TreeAttentionBuffers` (persistent masks and outputs);
* :mod:`.calls`: op names, :class:`OpCall` and the call builders;
* :mod:`.execute`: :func:`run_tree_verify`, :func:`run_draft_level`;
* :mod:`.graphs`: ACL graph capture and replay-time update;
* :mod:`.settings`: environment variables and :func:`resolve_settings`;
* :mod:`.synthetic`: synthetic verify batches and the ``tree_sparse`` probe.

Import from the submodules; this package re-exports nothing.
"""
