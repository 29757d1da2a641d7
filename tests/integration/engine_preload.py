"""What the engine runs' fork server imports before it forks (conftest.run_engine):
vLLM's entry point and the modules every CPU engine loads. Nothing here may start
a thread or run a kernel: forks of a process with threads or an OpenMP pool can hang."""

import vllm.model_executor.models.llama  # noqa: F401
import vllm.v1.engine.core  # noqa: F401
import vllm.v1.worker.cpu_model_runner  # noqa: F401
import vllm.v1.worker.cpu_worker  # noqa: F401
from vllm import LLM, SamplingParams, TokensPrompt  # noqa: F401
