#!/usr/bin/env bash
# Print the path of a Python interpreter of the given minor version (default 3.12): pythonX.Y on
# PATH, else the newest pyenv build of it ($PYENV_ROOT, ~/.pyenv). Exits 1 when there is none.
set -euo pipefail
want=${1:-3.12}
for cand in "$(command -v "python$want" || true)" \
            $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want".* 2>/dev/null | sort -V -r \
              | sed 's|$|/bin/python|'); do
  if [ -n "$cand" ] && [ -x "$cand" ] && \
     [ "$("$cand" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$want" ]
  then
    echo "$cand"
    exit 0
  fi
done
exit 1
