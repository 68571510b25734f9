#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, FUSE mount tests included (needs root
# or a user allowed to mount FUSE, and /dev/fuse).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
