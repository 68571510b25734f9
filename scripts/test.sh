#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, FUSE mount tests included (needs root
# or a user allowed to mount FUSE, and /dev/fuse).
#
# With no arguments it also runs the suite on Python 3.12 (what lerobot 0.6 needs), in a second
# virtualenv (.venv312) without torch: the torch build on local disk is for 3.11 only, so test
# modules that import torch are skipped there, and so are the POSIX suites marked `fuse` and the
# tests marked `slow` (healing, replication, crash loops, benchmark harness runs: code the other
# tests also run, so the interpreter is covered; this keeps CI short). PY312=0 skips it; with
# arguments only the 3.11 run happens, with them (./scripts/test.sh tests/test_meta.py -k x).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy  # the configuration in pyproject.toml: jpfs/ and daemon/

if (($#)) || [ "${PY312:-1}" = 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi

start=$SECONDS
echo "== Python $(.venv/bin/python -c 'import sys; print(sys.version.split()[0])') (torch, FUSE)"
.venv/bin/python -m pytest -q -p no:cacheprovider
echo "== $((SECONDS - start)) s"

py312=$(./scripts/find_python.sh 3.12) || {
  if [ "${CI:-}" = true ]; then
    echo "no Python 3.12 interpreter found (PATH, pyenv): CI needs one" >&2
    exit 1
  fi
  echo "== skipped the Python 3.12 run: no python3.12 found (PATH, pyenv)"
  exit 0
}
start=$SECONDS
VENV=.venv312 PYTHON="$py312" EXTRAS=video,test,plot ./scripts/setup.sh
echo "== Python $(.venv312/bin/python -c 'import sys; print(sys.version.split()[0])') (no torch; FUSE suites and slow tests on 3.11 only)"
.venv312/bin/python -m pytest -q -p no:cacheprovider -m "not fuse and not slow"
echo "== $((SECONDS - start)) s"
