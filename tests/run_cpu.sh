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
# The free disk where the tests write (a real-model test writes checkpoints of 1.6 GB; pyproject.toml has pytest delete
# a passed test's files), printed so that a full disk is seen as that.
df -h "${TMPDIR:-/tmp}" | tail -n 1 | awk '{print "free disk for the tests: " $4 " in " $6}' || true
set +e
# -v names each test; --durations=30 lists the 30 slowest, where the suite's time goes. Two pytest-xdist workers where
# the machine has two cores or more (TEST_WORKERS=N sets it; 0: one process), each taking a whole test module at a time
# (--dist loadscope: a module's servers and runs are set up once), in the order of tests/conftest.py's
# pytest_collection_modifyitems (--no-loadscope-reorder). Most of a test's time is one process at a time (a trainer,
# then its server), so a second worker uses the second core: on a 2-core VM with one core kept busy by another
# program, 70 minutes (AMD EPYC, AVX2) or 31-33 (Intel Xeon, AVX-512); in one process, with no core busy, the AMD VM
# had run 1,700 of the 1,887 tests in 68 minutes. No test races
# the load: a request held in flight is held by the test's own hand, and every wait bounds a failure, not the speed.
WORKERS=${TEST_WORKERS:-$( [ "$(nproc)" -ge 2 ] && echo 2 || echo 0 )}
"$VENV/bin/python" -m pytest tests -v -p no:cacheprovider --durations=30 \
  -n "$WORKERS" --dist loadscope --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
