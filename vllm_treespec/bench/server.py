"""One OpenAI-compatible vLLM server per method, on 127.0.0.1, and its /metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_prometheus(text: str) -> dict[str, float]:
    """{'name{labels}': value} for every sample of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """Sum of a series over all its label sets (e.g. over model_name/engine)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


class Server:
    """`vllm-treespec serve MODEL ...` in a subprocess; stopped by ``close``. ``cwd``:
    its working directory, first on its ``sys.path`` (``python -m``)."""

    def __init__(self, model: str, serve_args: list[str], speculative_config: dict | None,
                 log_path: Path, served_name: str = "bench", env: dict | None = None,
                 startup_timeout_s: float = 900, cwd: str | None = None):
        self.port = free_port()
        self.served_name = served_name
        args = [sys.executable, "-m", "vllm_treespec", "serve", model,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", served_name, *serve_args]
        if speculative_config:
            args += ["--speculative-config", json.dumps(speculative_config)]
        self.log_path = log_path
        self.cmd = args
        full_env = dict(os.environ)
        full_env.update(env or {})
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=cwd)
        self.base_url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + startup_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during startup; log: {log_path}\n"
                                   + log_path.read_text()[-3000:])
            try:
                urllib.request.urlopen(self.base_url + "/health", timeout=5)
                return
            except OSError:
                time.sleep(2)
        self.close()
        raise RuntimeError(f"server did not start in {startup_timeout_s} s; log: {log_path}")

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.base_url + "/metrics", timeout=30).read().decode()
        return parse_prometheus(text)

    def reset_prefix_cache(self) -> None:
        """Empty the server's prefix cache (needs VLLM_SERVER_DEV_MODE=1 in ``env``).

        The concurrency phases resend prompts the server has already seen. Plain
        decoding then reuses their cached blocks, while EAGLE methods (stock and
        tree) cannot: vLLM drops the last matched block for them, and on the CPU a
        block is 128 tokens, i.e. the whole cacheable part of most prompts here.
        Starting each phase cold compares the methods on prompts none has seen.
        """
        for _ in range(30):  # refused while blocks are held (a request still finishing)
            req = urllib.request.Request(self.base_url + "/reset_prefix_cache", data=b"",
                                         method="POST")
            answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
            if answer.get("success"):
                return
            time.sleep(1.0)
        raise RuntimeError(f"prefix cache reset refused for 30 s: {answer}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
