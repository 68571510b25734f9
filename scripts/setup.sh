#!/usr/bin/env bash
# Install what JPFS needs on a fresh Debian/Ubuntu machine: FUSE 3, etcd (and rsync and iproute2
# for the tests) and a virtualenv with JPFS, its test tools and the torch extra. Safe to rerun: it
# skips what is already there, and the package install when setup.cfg, pyproject.toml, the
# extras and the interpreter are the ones of the last run (a stamp in the virtualenv).
#
#   VENV=.venv312 PYTHON=python3.12 EXTRAS=video,test ./scripts/setup.sh   # a second venv
#
# VENV (default .venv), PYTHON (the interpreter that creates it; default python3), EXTRAS
# (default torch,video,test,plot; without "torch" no torch is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-torch,video,test,plot}

need_apt=()
command -v fusermount3 >/dev/null || need_apt+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need_apt+=(libfuse3-dev)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v rsync >/dev/null || need_apt+=(rsync)        # the FUSE tests run rsync on a mount
command -v ip >/dev/null || need_apt+=(iproute2)        # simulated hosts in bench aggregate
command -v etcd >/dev/null || need_apt+=(etcd-server)   # the cluster map of `jpfs cluster up`
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" gcc python3-dev >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  # A full disk fails pip deep in an install with a bare OSError; say it up front instead
  free_mib=$(df --output=avail -BM "$(dirname "$VENV")" | tail -1 | tr -dc 0-9)
  if [ "${free_mib:-0}" -lt 2500 ]; then
    echo "scripts/setup.sh: only ${free_mib} MiB free here; a new virtualenv ($VENV) takes about" \
      "2 GiB (torch's CPU build, pyarrow, the test tools). Free some space and run it again." >&2
    exit 1
  fi
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.jpfs-setup"
want="$(cat setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1) extras=$EXTRAS \
$("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])')"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/jpfs" ]; then
  exit 0  # installed from these files already; the package itself is an editable install
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
constrain=()
case ",$EXTRAS," in
  *,torch,*)
    # torch first, pinned: this machine image carries a CPU build of this release on disk; an
    # unpinned torch would pull a multi-GB CUDA build. The package itself asks for a range, and
    # pip's resolver may still swap the installed build for a newer CUDA one while it installs
    # the package (pip 26.3 does), so that install is held to the torch already there.
    "$VENV/bin/python" -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
    # The installed distribution's version, not torch.__version__: PyPI's CUDA wheels say
    # 2.11.0 in their metadata and 2.11.0+cu130 at run time, and pip matches the former.
    "$VENV/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
      > "$VENV/.jpfs-torch"
    constrain=(-c "$VENV/.jpfs-torch") ;;
esac
$PIP install -q ${constrain[@]+"${constrain[@]}"} -e ".[$EXTRAS]"
echo "$want" > "$stamp"
