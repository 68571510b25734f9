"""The services' clients: requests to metadata shards (``meta``) and storage nodes (``storage``,
with ``shortcircuit`` reading a same-host node's volumes directly). Nothing above this speaks the
wire; tools and benchmarks that measure a service itself use these two classes."""

from .meta import MetaClient
from .storage import StorageClient

__all__ = ["MetaClient", "StorageClient"]
