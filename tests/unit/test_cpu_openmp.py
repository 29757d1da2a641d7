"""Intel OpenMP for vLLM's CPU engine processes (``vllm_treespec/cpu_openmp.py``)."""

import os
import platform
import subprocess
import sys

import pytest

from vllm_treespec import cpu_openmp
from vllm_treespec.cpu_openmp import ENV, libiomp5, preload_intel_openmp

X86_LINUX = sys.platform.startswith("linux") and platform.machine() == "x86_64"


def _libraries_in_use(env: dict) -> str:
    """/proc/self/maps of a fresh Python that imports torch and runs a parallel op."""
    code = "import torch; torch.ones(1 << 22).sum(); print(open('/proc/self/maps').read())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.skipif(not X86_LINUX or libiomp5() is None,
                    reason="needs the intel-openmp wheel on x86-64 Linux")
def test_a_process_started_with_it_runs_intel_openmp():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV)}
    assert "libiomp5" not in _libraries_in_use(env)  # torch alone: GNU libgomp
    assert preload_intel_openmp(env) == libiomp5()
    assert "libiomp5" in _libraries_in_use(env)


@pytest.fixture
def fake_x86_prefix(monkeypatch, tmp_path):
    library = tmp_path / "lib" / "libiomp5.so"
    library.parent.mkdir()
    library.write_bytes(b"")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(cpu_openmp.platform, "machine", lambda: "x86_64")
    return library


def test_it_goes_first_and_other_preloads_stay(fake_x86_prefix):
    env = {"LD_PRELOAD": "/opt/lib/libtcmalloc.so.4"}
    assert preload_intel_openmp(env) == fake_x86_prefix
    assert env["LD_PRELOAD"] == f"{fake_x86_prefix}:/opt/lib/libtcmalloc.so.4"
    env = {}
    assert preload_intel_openmp(env) == fake_x86_prefix
    assert env["LD_PRELOAD"] == str(fake_x86_prefix)


@pytest.mark.parametrize("runtime", ["/usr/lib/libgomp.so.1", "/opt/intel/libiomp5.so",
                                     "/usr/lib/llvm/libomp.so"])
def test_an_openmp_runtime_already_chosen_is_kept(fake_x86_prefix, runtime):
    env = {"LD_PRELOAD": f"/opt/lib/libtcmalloc.so.4:{runtime}"}
    assert preload_intel_openmp(env) is None
    assert env == {"LD_PRELOAD": f"/opt/lib/libtcmalloc.so.4:{runtime}"}


def test_switched_off_missing_or_another_platform(fake_x86_prefix, monkeypatch):
    env = {ENV: "0"}
    assert preload_intel_openmp(env) is None and env == {ENV: "0"}
    monkeypatch.setattr(cpu_openmp.platform, "machine", lambda: "aarch64")
    env = {}
    assert preload_intel_openmp(env) is None and env == {}
    monkeypatch.setattr(cpu_openmp.platform, "machine", lambda: "x86_64")
    fake_x86_prefix.unlink()
    assert preload_intel_openmp(env) is None and env == {}
