"""Fixtures for tests that run real vLLM engines on the CPU (SmolLM2-135M)."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

# The CPU runner's linear layers: "0" = vLLM's oneDNN kernels, "keep" = the W @ x^T
# dispatchers (cpu_linear). Without a pin, a ~7 s startup probe picks per machine (the
# dispatchers on AVX2, oneDNN on AVX-512), so a test's call path would depend on where
# it runs. Engines pin oneDNN unless a test asks otherwise (the batch-8 greedy test and
# the compiled frame-stack test pin the dispatchers, so both paths run everywhere).
from vllm_treespec.vllm_glue.cpu_linear import ENV as SMALL_M_LINEAR_ENV

ROOT = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 900


def pinned_kernels() -> dict[str, str]:
    """The linear-kernel pin of every test engine and server (see above); a value
    already in the environment wins."""
    return {SMALL_M_LINEAR_ENV: os.environ.get(SMALL_M_LINEAR_ENV, "0")}


def small_block_size() -> int:
    """The smallest KV block the installed vLLM's CPU attention takes (16 tokens on
    0.27.1, 32 on 0.32.0), for tests that want many block boundaries."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend.get_supported_kernel_block_sizes()[0].base


def base_engine(target: Path, **overrides) -> dict:
    """Engine settings shared by the integration tests (fp32: greedy comparisons
    between differently shaped batches must not hinge on bf16 rounding)."""
    engine = {"model": str(target), "compilation_config": {"mode": 0},
              "max_model_len": 2048, "seed": 0, "dtype": "float32", "max_num_seqs": 8}
    engine.update(overrides)
    return engine


# The modules every engine run imports first (~13 s of each run's startup on a 2-core
# machine), imported once by a fork server whose forks then run the engines.
ENGINE_PRELOAD = "tests.integration.engine_preload"
_engine_processes = None


def engine_processes():
    """The fork server's context: each engine runs in a fresh fork of a process that has
    imported vLLM but run nothing, so engines still share no state."""
    global _engine_processes
    if _engine_processes is None:
        _engine_processes = multiprocessing.get_context("forkserver")
        _engine_processes.set_forkserver_preload([ENGINE_PRELOAD])
    return _engine_processes


def run_engine(spec: dict, workdir: Path, name: str, extra_env: dict | None = None) -> dict:
    """Run ``tests.integration.engine_run`` on ``spec`` in a fresh process (``extra_env``:
    more environment variables)."""
    from tests.integration.engine_run import run_forked

    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    # One process: the engine core and its worker run in this fork instead of two
    # more spawned ones (each importing vLLM again).
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONPATH=str(ROOT),
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.update(pinned_kernels(), **(extra_env or {}))
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = engine_processes().Process(target=run_forked, name=f"engine-{name}", args=(
        str(spec_path), str(out_path), str(log_path), env, str(ROOT)))
    proc.start()
    proc.join(ENGINE_TIMEOUT_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"engine run {name!r} ran over {ENGINE_TIMEOUT_S} s; see {log_path}")
    if proc.exitcode != 0:
        # No log: the fork died before it opened one (the fork server's own errors go
        # to this process's stderr).
        tail = log_path.read_text()[-6000:] if log_path.exists() else "(no log)"
        raise AssertionError(f"engine run {name!r} failed (rc={proc.exitcode}):\n{tail}")
    return json.loads(out_path.read_text())


@pytest.fixture(scope="session")
def target_dir() -> Path:
    from vllm_treespec.assets import cache_home, ensure_target

    home = cache_home()
    home.mkdir(parents=True, exist_ok=True)
    return ensure_target(home)


@pytest.fixture(scope="session")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="session")
def random_drafter(target_dir, tmp_path_factory) -> Path:
    from tests.integration.drafters import random_eagle3_drafter

    return random_eagle3_drafter(target_dir, tmp_path_factory.mktemp("drafter"))


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


GREEDY_TOKENS = 128
SHORT_GREEDY_TOKENS = 64


@pytest.fixture(scope="session")
def greedy_reference(target_dir, tokenizer, engine_dir) -> tuple[list, list]:
    """(prompts, plain vLLM's greedy outputs): the 25 chat prompts, 128 tokens each."""
    from tests.integration.prompts import chat_token_ids

    prompts = chat_token_ids(tokenizer)
    plain = run_engine({"engine": base_engine(target_dir), "prompts": prompts,
                        "sampling": {"temperature": 0.0, "max_tokens": GREEDY_TOKENS}},
                       engine_dir, "greedy_reference")
    return prompts, [o[0] for o in plain["outputs"]]


@pytest.fixture(scope="session")
def short_greedy_reference(greedy_reference) -> tuple[list, dict]:
    """(prompts, plain vLLM's greedy run): 8 chat prompts, 64 tokens each — the
    start of ``greedy_reference`` (greedy fp32 decoding does not depend on how far
    it goes on), in ``run_engine``'s output layout."""
    prompts, outputs = greedy_reference
    return prompts[:8], {"outputs": [[o[:SHORT_GREEDY_TOKENS]] for o in outputs[:8]]}
