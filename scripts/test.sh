#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, FUSE mount tests included (needs root
# or a user allowed to mount FUSE, and /dev/fuse).
#
# With no arguments it also runs part of the suite on Python 3.12 (what lerobot 0.6 needs), in a
# second virtualenv (.venv312) without torch (the torch build on local disk is for 3.11 only):
# the modules in PY312_TESTS, which run every layer once (the wire, metadata, storage, the data
# path, the mount's units and requests, leases, fsspec, the converter, the CLI's errors, abusive
# clients), less the tests marked `fuse` or `slow`. The whole suite is pure Python over the same
# wheels, so this covers the interpreter in a third of the time and keeps CI well under 20
# minutes; PY312_TESTS=tests runs all of it there. PY312=0 skips the 3.12 run; with arguments
# only the 3.11 run happens, with them (./scripts/test.sh tests/test_meta.py -k x).
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
echo "== Python $(.venv312/bin/python -c 'import sys; print(sys.version.split()[0])') (no torch; PY312_TESTS, less FUSE suites and slow tests)"
default_312="tests/test_imports.py tests/test_placement.py tests/test_rpc.py tests/test_rpc_buffers.py
  tests/test_meta.py tests/test_meta_leases.py tests/test_heal_plan.py tests/test_storage.py
  tests/test_storage_store.py tests/test_data.py tests/test_fuse_units.py tests/test_fuse_protocol.py
  tests/test_fuse_requests.py tests/test_blocking_api.py
  tests/test_fsspec_clusters.py tests/test_lerobot_convert.py tests/test_cli_errors.py
  tests/test_daemon_abuse.py"
# shellcheck disable=SC2086  # a list of paths
.venv312/bin/python -m pytest -q -p no:cacheprovider -m "not fuse and not slow" ${PY312_TESTS:-$default_312}
echo "== $((SECONDS - start)) s"
