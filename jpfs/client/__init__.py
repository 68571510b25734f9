"""The native client: metadata and storage calls, path-level API, caches and prefetch."""

from .blocking import Client, connect
from .client import AsyncClient, Entry, aconnect

__all__ = ["AsyncClient", "Client", "Entry", "aconnect", "connect"]
