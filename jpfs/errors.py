"""One exception family for all of JPFS, each carrying a POSIX errno.

Servers raise these, the RPC layer sends them as errno *names* (portable across hosts), the client
re-raises them with the same errno, and the FUSE layer converts them to ``FUSEError`` at exactly one
place. ``JPFSError`` subclasses ``OSError`` so ordinary Python code (``except FileNotFoundError``)
works on the native client too.
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "JPFSError",
    "ProtocolError",
    "AuthError",
    "DeadlineError",
    "Unavailable",
    "ChecksumError",
    "error",
    "errno_name",
    "from_name",
]


class JPFSError(OSError):
    """An error with a POSIX errno. ``str()`` reads like the OS's own messages."""

    def __init__(self, err: int, message: str | None = None, filename: str | None = None):
        super().__init__(err, message or os.strerror(err))
        if filename is not None:
            self.filename = filename

    def __reduce__(self):  # keeps the errno across pickling (DataLoader workers, multiprocessing)
        return (error, (self.errno, self.strerror, self.filename))


class ProtocolError(JPFSError):
    """The peer spoke something other than the JPFS protocol (bad frame, bad types)."""

    def __init__(self, message: str):
        super().__init__(_errno.EPROTO, message)


class AuthError(JPFSError, PermissionError):
    """The handshake failed: the peer does not hold the cluster secret."""

    def __init__(self, message: str = "authentication failed: wrong cluster secret"):
        super().__init__(_errno.EACCES, message)


class DeadlineError(JPFSError, TimeoutError):
    """A call did not finish within its deadline."""

    def __init__(self, message: str = "deadline exceeded"):
        super().__init__(_errno.ETIMEDOUT, message)


class Unavailable(JPFSError, ConnectionError):
    """A server could not be reached (refused, reset, or down)."""

    def __init__(self, message: str):
        super().__init__(_errno.EHOSTUNREACH, message)


class ChecksumError(JPFSError):
    """Bytes read back do not match their recorded checksum."""

    def __init__(self, message: str):
        super().__init__(_errno.EIO, message)


_BY_NAME = {name: value for value, name in _errno.errorcode.items()}


def errno_name(err: int | None) -> str:
    """The symbolic name of an errno (``ENOENT``), which is what travels on the wire; ``EIO`` for
    an unknown one or none (an ``OSError`` made without an errno has ``errno`` None)."""
    return _errno.errorcode.get(err, "EIO") if err is not None else "EIO"


def from_name(name: str, message: str | None = None) -> JPFSError:
    """Rebuild the exception a server sent as an errno name; unknown names become EIO."""
    err = _BY_NAME.get(name, _errno.EIO)
    if err == _errno.EPROTO:
        return ProtocolError(message or "protocol error")
    if err == _errno.EACCES and message and message.startswith("authentication"):
        return AuthError(message)
    if err == _errno.ETIMEDOUT:
        return DeadlineError(message or "deadline exceeded")
    return error(err, message)


_SPECIFIC: dict[type, type] = {}


def _class_for(err: int) -> type[JPFSError]:
    """JPFSError mixed with the builtin OSError subclass for ``err`` (FileNotFoundError, ...)."""
    builtin = type(OSError(err, ""))
    if builtin is OSError:
        return JPFSError
    cls = _SPECIFIC.get(builtin)
    if cls is None:
        cls = type(builtin.__name__, (JPFSError, builtin), {"__module__": __name__})
        _SPECIFIC[builtin] = cls
    return cls


def error(err: int | None, message: str | None = None, filename: str | None = None
          ) -> JPFSError:
    """The JPFSError for an errno and a message, naming the path where there is one.

    ``raise error(ENOENT, "no such entry", path)``. The instance is also the matching builtin
    (``FileNotFoundError`` for ENOENT), so callers of the native client can catch what they
    would catch from ``os`` calls. An errno of None (an ``OSError`` that carried none) is EIO.
    """
    err = err or _errno.EIO
    return _class_for(err)(err, message, filename)
