"""The JPFS wire protocol: frames, handshake, ``serve()`` and pooled clients."""

from .client import Connection, Pool, connect
from .frame import FileSegment, Limits
from .server import serve
from .service import Defer, Handler, Later, Method, Reply, Service, method_table

__all__ = [
    "Connection", "Defer", "FileSegment", "Handler", "Later", "Limits", "Method", "Pool", "Reply",
    "Service", "connect", "method_table", "serve",
]
