"""Reading records whose wire form is a map (status answers that operators read as JSON).

A map answer keeps JSON output readable and lets a key added later leave older readers working:
a reader takes the keys its record names and ignores the rest. ``from_map`` is the one place
such a record is read from its map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def from_map(cls: Any, w: object, optional: Mapping[str, object] | None = None) -> Any:
    """The record ``cls`` (a NamedTuple) from a map holding a key per field (more are ignored);
    a field named in ``optional`` may be missing (an older sender's answer) and then takes the
    value given there. TypeError or KeyError when ``w`` is not such a map (``Method.decode``
    turns them into a ProtocolError)."""
    if type(w) is not dict:
        raise TypeError(f"{cls.__name__} must be a map, not {type(w).__name__}")
    if not optional:
        return cls._make([w[k] for k in cls._fields])
    return cls._make([w[k] if k in w or k not in optional else optional[k]
                      for k in cls._fields])


__all__ = ["from_map"]
