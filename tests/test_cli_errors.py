"""What the command line tells a user when a command fails or is interrupted: one line and an
exit status, also where trio wrapped the error in an exception group."""

from __future__ import annotations

import errno

from jpfs.cli.main import _reportable
from jpfs.errors import error


def test_interrupt_inside_a_nursery_is_an_interrupt():
    group = BaseExceptionGroup("nursery", [KeyboardInterrupt("signal 15")])
    assert _reportable(BaseExceptionGroup("outer", [group, ValueError("x")])) is KeyboardInterrupt
    assert _reportable(KeyboardInterrupt()) is KeyboardInterrupt


def test_ordinary_errors_in_a_group_report_the_first():
    first = error(errno.ENOENT, "no such file")
    got = _reportable(ExceptionGroup("nursery", [ExceptionGroup("inner", [first]),
                                                 OSError(errno.EIO, "io")]))
    assert got is first


def test_a_bug_in_a_group_keeps_its_traceback():
    assert _reportable(ExceptionGroup("nursery", [OSError(1, "x"), TypeError("bug")])) is None
    plain = OSError(errno.EACCES, "denied")
    assert _reportable(plain) is plain
