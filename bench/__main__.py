"""``python -m jpfs_bench NAME [options]``: a benchmark without the ``jpfs`` command."""

from .entry import main

raise SystemExit(main())
