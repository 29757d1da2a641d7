"""Plain vLLM engines on Model Runner V2 (MRV2) on the CPU, for tests only.

vLLM 0.32.0's MRV2 needs Triton; on this CPU it runs under Triton's interpreter, with a
stub backend registered before vLLM is imported (``engine.install_interpreter_backend``).
So each engine runs in a fresh process whose environment is set before it starts, never
in the integration tests' fork server (that server has imported vLLM already, without
the stub). The plugin stays installed: it loads in every engine process and leaves a
plain engine's runner choice alone (``versions.keep_v1_model_runner`` applies to
``eagle3_tree`` configs only), so ``VLLM_USE_V2_MODEL_RUNNER=1`` alone picks MRV2.

The interpreter runs each Triton kernel launch in numpy, so these tests are slow and run
only when asked: ``bash scripts/test-mrv2.sh`` (docs/mrv2.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATE = "TREESPEC_MRV2"  # "1": run the MRV2 tests (scripts/test-mrv2.sh sets it)
ENGINE_TIMEOUT_S = 1500  # the T > 0 tests' plain engine draws hundreds of samples
V2_RUNNER = "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
V2_BASE = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
V1_RUNNER = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"

# Per runner: what selects it. V1 is named explicitly, so that a future default cannot
# turn the reference engine into a second MRV2 run.
RUNNER_ENV = {
    "v2": {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1",
           "VLLM_TREESPEC_MRV2_PREVIEW": "1"},  # the tree slice's opt-in (mrv2.checks)
    "v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
}


def enabled() -> bool:
    return os.environ.get(GATE) == "1"


def has_mrv2() -> bool:
    """The installed vLLM ships MRV2's CPU runner (0.27.1 does not), read without
    importing vLLM."""
    from vllm_treespec.commands.mrv2_api import installed_vllm

    try:
        return (installed_vllm() / "v1" / "worker" / "cpu" / "model_runner.py").is_file()
    except FileNotFoundError:
        return False


def engine_env(runner: str) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # collective_rpc with a function
               VLLM_ENABLE_V1_MULTIPROCESSING="0",  # one process: the stub reaches the worker
               PYTHONPATH=str(ROOT))
    env.update(RUNNER_ENV[runner])
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def run_engine(spec: dict, workdir: Path, name: str, runner: str,
               interpreter_backend: bool = True, module: str = "tests.mrv2.engine") -> dict:
    """``module`` (``tests.mrv2.engine``, or ``tests.mrv2.tree_engine`` for tree
    engines) on ``spec`` with ``runner`` ("v2" or "v1") in a fresh process; its log is
    ``workdir/NAME.log``. ``interpreter_backend=False`` leaves the Triton stub out (a
    control: vLLM then refuses MRV2)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(dict(spec, runner=runner,
                                         interpreter_backend=interpreter_backend)))
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run([sys.executable, "-m", module, str(spec_path),
                                   str(out_path)], cwd=ROOT, env=engine_env(runner),
                                  stdout=log, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"engine run {name!r} ran over {ENGINE_TIMEOUT_S} s; "
                                 f"see {log_path}") from None
    if proc.returncode != 0:
        raise EngineFailed(name, proc.returncode, log_path.read_text(errors="replace"))
    return json.loads(out_path.read_text())


class EngineFailed(AssertionError):
    def __init__(self, name: str, returncode: int, log: str):
        super().__init__(f"engine run {name!r} failed (rc={returncode}):\n{log[-6000:]}")
        self.log = log
