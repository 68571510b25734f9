"""Signals as a program run from a terminal has them, for tests that interrupt a child.

A test suite started as a background job of a script (``cmd &`` in a shell without job
control, ``nohup``) has SIGINT and SIGQUIT ignored, and every child inherits that: a child sent
SIGINT, as Ctrl-C would, then goes on. Children that the tests interrupt get the default
disposition back before they run (``preexec_fn=foreground_signals``), as a program in a
terminal's foreground has it, so the test checks the program and not how the suite was started.
"""

from __future__ import annotations

import signal


def foreground_signals() -> None:
    """In the child before exec: SIGINT and SIGQUIT at their default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
