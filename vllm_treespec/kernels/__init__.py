"""Our own device kernels, in Triton.

* :mod:`.tree_attention`: paged tree attention for verify steps (prefill,
  decode and tree rows in one launch), for CUDA GPUs and, through
  triton-ascend, Ascend NPUs; checked on the CPU under ``TRITON_INTERPRET=1``.

Importing this package never needs triton; launching a kernel does.
"""
