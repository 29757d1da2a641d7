"""Tree speculation inside vllm-ascend (targets vllm-ascend main of 2026-08-22 with
vLLM 0.27.1). Imported only by the NPU worker, i.e. only when the platform is an
Ascend NPU and the speculative method is ``eagle3_tree``: CPU installs never
import these modules, torch_npu or vllm_ascend. This ``__init__`` imports nothing
(the submodules import torch_npu and vllm_ascend), so the package itself imports
anywhere.

What it adds to vllm-ascend, all selected in tree mode only:

* ``TreeAscendAttentionBackend`` / ``TreeAscendAttentionImpl`` /
  ``TreeAscendMetadataBuilder`` (:mod:`.backend`): vllm-ascend's GQA attention
  with tree rows. vllm-ascend's ``NPUPlatform.get_attn_backend_cls`` ignores the
  requested backend, so :func:`~.backend.install_backend` wraps it (idempotently,
  in the worker, after every plugin has loaded) to answer this backend when the
  engine is in tree mode and the stock answer is the GQA backend.
* ``TreeNPUWorker`` (:mod:`.worker`): ``NPUWorker`` whose runner is
  ``NPUModelRunner`` + the device-agnostic ``TreeRunnerMixin`` (:mod:`.runner`;
  swapped in for ``init_device`` only, as the CPU worker does), with the drafter
  built on vllm-ascend's EAGLE proposer (:mod:`.proposer`).

Modules, in dependency order: :mod:`.backend`, :mod:`.proposer`, :mod:`.runner`,
:mod:`.worker`. Import from the submodules; this package re-exports nothing
(the worker is named by its full path, ``...ascend.worker.TreeNPUWorker``).
"""
