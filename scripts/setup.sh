#!/usr/bin/env bash
# Install what JPFS needs on a fresh Debian/Ubuntu machine: FUSE 3 (and rsync and iproute2 for
# the tests) and a virtualenv with JPFS, its test tools and the torch extra. Safe to rerun; it
# skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

need_apt=()
command -v fusermount3 >/dev/null || need_apt+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need_apt+=(libfuse3-dev)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v rsync >/dev/null || need_apt+=(rsync)        # the FUSE tests run rsync on a mount
command -v ip >/dev/null || need_apt+=(iproute2)        # simulated hosts in bench aggregate
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" gcc python3-dev >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first, pinned: this machine image carries a CPU build of this release on disk; an
# unpinned torch would pull a multi-GB CUDA build. The package itself asks for a range.
$VENV/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
$PIP install -q -e ".[torch,video,test,plot]"
