"""A READDIR answer's entries, added the same way whichever engine answers the request.

pyfuse3 fills its answer through ``pyfuse3.readdir_reply`` and a token of its own; JPFS's engine
passes an ``EntrySink`` instead. The adapter and the control tree add entries through
``readdir_reply`` and never learn which it is.
"""

from __future__ import annotations

from typing import Protocol

import pyfuse3


class EntrySink(Protocol):
    """Where a READDIR's entries go when pyfuse3 does not answer it (``engine.DirBuffer``)."""

    def add(self, name: bytes, entry: pyfuse3.EntryAttributes, next_id: int) -> bool:
        """Take one entry; False once it does not fit (the listing stops there)."""
        ...


def readdir_reply(token, name: bytes, entry: pyfuse3.EntryAttributes, next_id: int) -> bool:
    """Add an entry to a READDIR answer: pyfuse3's token, or an ``EntrySink`` of another
    engine; False once it does not fit."""
    if isinstance(token, pyfuse3.ReaddirToken):
        return pyfuse3.readdir_reply(token, name, entry, next_id)
    return token.add(name, entry, next_id)


__all__ = ["EntrySink", "readdir_reply"]
