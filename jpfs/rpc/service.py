"""Method specifications shared by servers (argument checks) and clients (retry policy)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import JPFSError, errno_name, error
from .frame import Payload

_EINVAL = 22


@dataclass(frozen=True)
class Method:
    """One remote method: its name, positional argument types and call properties.

    ``args`` holds one entry per positional argument: a type, a tuple of types, or ``None`` for
    anything. The last ``optional`` arguments may be left out. ``idempotent`` methods are retried
    by the client after a lost connection; ``payload`` methods receive the request payload as a
    keyword argument.
    """

    name: str
    args: tuple = ()
    optional: int = 0
    idempotent: bool = False
    payload: bool = False

    def check(self, args: object) -> list:
        """Raise EINVAL unless ``args`` fit this method's signature.

        Types are matched exactly (what msgpack decodes to), so a bool is never taken for an
        int; runs for every request, hence the precomputed type sets."""
        if type(args) is not list:
            raise error(_EINVAL, f"{self.name}: arguments must be a list")
        lo, exact = self._exact
        if not lo <= len(args) <= len(exact):
            want = f"{lo}" if lo == len(exact) else f"{lo} to {len(exact)}"
            raise error(_EINVAL, f"{self.name}: takes {want} arguments, got {len(args)}")
        for i, value in enumerate(args):
            kinds = exact[i]
            if kinds is None:
                continue
            t = type(value)
            if t not in kinds:
                if value is None and i >= lo:
                    continue
                raise error(_EINVAL, f"{self.name}: argument {i} has type {t.__name__}")
            if t is int and not -(1 << 63) <= value < (1 << 64):
                raise error(_EINVAL, f"{self.name}: argument {i} out of range")
        return args

    @functools.cached_property
    def _exact(self) -> tuple[int, tuple[frozenset | None, ...]]:
        """(required argument count, the set of accepted types per argument or None)."""
        sets = tuple(None if k is None else frozenset(k if isinstance(k, tuple) else (k,))
                     for k in self.args)
        return len(self.args) - self.optional, sets


class Defer(Exception):
    """Raised by a ``<method>_now`` handler that cannot answer without waiting, or given as the
    error that settles its ``Later``: the request is then run by the async handler in a task of
    its own."""


class Later:
    """Returned by a ``<method>_now`` handler whose answer comes from a callback, such as a write
    queued to the next group commit: the server sends the answer from ``settle`` with no task
    of its own per request (dropping a task, a cancel scope and an event per create made
    creates 1.3-1.4x faster on one shard)."""

    __slots__ = ("_on_settled", "_outcome")

    def __init__(self) -> None:
        self._on_settled: Callable[[object, BaseException | None], None] | None = None
        self._outcome: tuple[object, BaseException | None] | None = None

    def settle(self, result: object = None, exc: BaseException | None = None) -> None:
        """Give the answer (or the error); the first call counts."""
        if self._outcome is not None:
            return
        self._outcome = (result, exc)
        if self._on_settled is not None:
            self._on_settled(result, exc)

    def on_settled(self, fn: Callable[[object, BaseException | None], None]) -> None:
        """Call ``fn(result, exc)`` once settled (at once when that has happened already)."""
        self._on_settled = fn
        if self._outcome is not None:
            fn(*self._outcome)


@dataclass
class Reply:
    """A handler's answer with a raw payload (bytes or ``FileSegment``s for ``sendfile``)."""

    result: object
    payload: Payload = ()
    on_sent: object = None
    """Optional callable run after the payload is on the wire (releases pinned volumes)."""


@dataclass
class Service:
    """What a server offers: a role name and its methods, bound to an implementation object.

    Each method ``m`` is served by ``impl.m(*args)`` (``payload=`` added for payload methods).
    An implementation may also offer ``impl.m_now(*args)``, a plain function that answers at once,
    returns a ``Later``, or raises ``Defer``: the server calls it inline, saving a task and a
    scheduler pass per request (most metadata reads answer in microseconds). A method whose
    ``m_now`` never defers needs no ``impl.m``.
    """

    role: str
    methods: dict[str, Method]
    impl: object
    handlers: dict = field(init=False)
    inline: dict = field(init=False)
    requests: dict[str, int] = field(init=False)
    """Requests received, by method (for metrics)."""
    errors: dict[str, int] = field(init=False)
    """Requests answered with an error, by errno name."""

    def count_error(self, err: JPFSError) -> None:
        name = errno_name(err.errno)
        self.errors[name] = self.errors.get(name, 0) + 1

    def __post_init__(self):
        self.requests = dict.fromkeys(self.methods, 0)
        self.errors = {}
        self.handlers, self.inline = {}, {}
        for name in self.methods:
            fn = getattr(self.impl, name, None)
            now = getattr(self.impl, f"{name}_now", None)
            if now is not None and self.methods[name].payload:
                now = None
            if fn is None and now is None:
                raise TypeError(f"{type(self.impl).__name__} does not implement {name}")
            if fn is not None:
                self.handlers[name] = fn
            if now is not None:
                self.inline[name] = now


def method_table(*methods: Method) -> dict[str, Method]:
    table = {m.name: m for m in methods}
    if len(table) != len(methods):
        raise ValueError("duplicate method names")
    return table


def as_error(exc: BaseException) -> JPFSError | None:
    """JPFSError for the errors a handler may raise on bad input; None for anything else."""
    if isinstance(exc, JPFSError):
        return exc
    if isinstance(exc, (TypeError, ValueError, OverflowError, UnicodeError)):
        return error(_EINVAL, f"invalid argument: {exc}")
    return None


__all__: Sequence[str] = ["Defer", "Later", "Method", "Reply", "Service", "method_table",
                          "as_error"]
