"""The JPFS wire protocol: frames, handshake, ``serve()`` and pooled clients."""

from .client import Connection, Pool, Refused, Silent, connect
from .frame import FileSegment, Limits
from .server import serve
from .service import Defer, Handler, Later, Method, Reply, Service, method_table

__all__ = [
    "Connection", "Defer", "FileSegment", "Handler", "Later", "Limits", "Method", "Pool", "Refused",
    "Reply", "Service", "Silent", "connect", "method_table", "serve",
]
