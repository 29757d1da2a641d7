import os

from hypothesis import HealthCheck, settings

# Deterministic, CI-sized property runs; HYPOTHESIS_PROFILE=thorough for more.
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# vLLM's CPU worker binds its OpenMP threads to all cores but one by default (the one
# left is for the frontend); on a 2-core CI machine that halves every engine's speed.
# The engines the tests start inherit this (an explicit setting wins).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                      ",".join(map(str, sorted(os.sched_getaffinity(0)))))

# Our Triton kernels (vllm_treespec.kernels) run under Triton's CPU interpreter
# when no CUDA device is present; triton reads this when a kernel module is
# imported. vLLM's own Triton use stays off on the CPU either way (it checks for
# an active GPU driver, not this variable).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
