#!/usr/bin/env bash
# Set up a CPU-only machine (tests/setup_cpu.sh), check formatting and lint (ruff), run the test suite:
# bash tests/run_cpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
bash tests/setup_cpu.sh
# every Python file as ruff formats it, and no finding of ruff's checks (pyproject.toml: line 120; E, F, W, B, I, SIM)
"$VENV/bin/ruff" format --check --diff .
"$VENV/bin/ruff" check .
set +e
# -v names each test; --durations=30 lists the 30 slowest, where the suite's time goes. One process by default.
# TEST_WORKERS=2: two pytest-xdist workers, each taking a whole test module at a time (--dist loadscope: a module's
# servers and runs are set up once), in the order of tests/conftest.py's pytest_collection_modifyitems
# (--no-loadscope-reorder). Faster, but on a 2-core machine with a core kept busy the two workers' servers load it
# so much that timing tests can fail (a request to be caught in flight during a push ends first).
"$VENV/bin/python" -m pytest tests -v -p no:cacheprovider --durations=30 \
  -n "${TEST_WORKERS:-0}" --dist loadscope --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
