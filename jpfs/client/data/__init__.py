"""The data path shared by the path API and the VFS: storing bytes (``store``), one chunk
assembly (``reader``), buffered writes (``writer``), the blob cache (``cache``, ``segments``), and
prefetch (``prefetch``, ``coaccess``, ``listings``)."""
