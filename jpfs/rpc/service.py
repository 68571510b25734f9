"""Method declarations shared by servers (argument checks, handler binding) and clients
(retry policy, answer decoding).

Every remote method is declared once, as 3FS's ``SERDE_SERVICE_METHOD`` does: a wire id, a name,
a request record (a ``NamedTuple`` whose fields are the positional arguments, with their types),
a response record (a class with ``from_wire``, or a plain type), and its call properties. The
server derives its argument checks from the request record and checks every request once, before
any handler runs; handlers are bound to declarations explicitly (``Handler``), never found by name.
"""

from __future__ import annotations

import types as _types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import JPFSError, ProtocolError, errno_name, error
from .frame import Payload, receive_buffer

_EINVAL = 22
_INT_MIN, _INT_END = -(1 << 63), 1 << 64


def _kinds(hint) -> tuple[frozenset | None, bool, frozenset | None]:
    """(accepted types or None for any, None allowed, element types of a list or None)."""
    if hint is typing.Any or hint is object:
        return None, True, None
    if hint is None or hint is type(None):
        return frozenset({type(None)}), True, None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is _types.UnionType:
        kinds: set = set()
        none = False
        for h in typing.get_args(hint):
            if h is type(None):
                none = True
                continue
            k, _, elems = _kinds(h)
            if k is None or elems is not None:
                return None, True, None  # unions of lists or of anything: not checked deeper
            kinds |= k
        return frozenset(kinds), none, None
    if origin is list:
        (elem,) = typing.get_args(hint) or (object,)
        ek, enone, eelems = _kinds(elem)
        if ek is not None and (enone or eelems is not None):
            ek = None  # only flat element types are checked
        return frozenset({list}), False, ek
    if origin is not None:
        return frozenset({origin}), False, None
    if hint is float:
        return frozenset({int, float}), False, None  # as in typing: an int is a float
    return frozenset({hint}), False, None


@dataclass(frozen=True, eq=False)
class Method:
    """One remote method, declared once for both sides.

    ``request`` is a ``NamedTuple`` class: its fields are the positional arguments in order,
    their annotations the accepted types (matched exactly, as msgpack decodes them, so a bool is
    never taken for an int; ``float`` accepts ints; ``X | None`` accepts None; ``list[int]`` and
    ``list[bytes]`` check every element), and fields with defaults may be left out.
    ``response`` is what the answer decodes to: a class with ``from_wire`` (a record), or a plain
    type the answer already is (``list[bytes]`` and the like: every element checked too).
    ``idempotent`` methods are retried by the client after a lost connection; ``payload``
    methods receive the request payload as a keyword argument; ``inline`` methods have a
    handler that answers on the request loop itself (see ``Handler``).
    """

    id: int
    name: str
    request: type
    response: object = None
    idempotent: bool = False
    payload: bool = False
    inline: bool = False
    # derived from ``request`` and ``response`` once, in __post_init__
    _required: int = field(init=False, repr=False, default=0)
    _fields: tuple[str, ...] = field(init=False, repr=False, default=())
    _checks: tuple = field(init=False, repr=False, default=())
    _decode: Callable | None = field(init=False, repr=False, default=None)
    _plain: tuple | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if type(self.id) is not int or not 0 < self.id < (1 << 16):
            raise ValueError(f"{self.name}: method ids are 1 to 65535")
        hints = typing.get_type_hints(self.request)
        fields = getattr(self.request, "_fields", None)
        if fields is None:
            raise TypeError(f"{self.name}: the request record must be a NamedTuple")
        defaults = getattr(self.request, "_field_defaults", {})
        checks = tuple(_kinds(hints[f]) for f in fields)
        object.__setattr__(self, "_required", len(fields) - len(defaults))
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_checks", checks)
        decode = getattr(self.response, "from_wire", None)
        object.__setattr__(self, "_decode", decode)
        plain = None if decode is not None or self.response is None else _kinds(self.response)
        object.__setattr__(self, "_plain", plain)

    def check(self, args: object) -> list:
        """Raise EINVAL unless ``args`` fit the request record; runs once per request."""
        if type(args) is not list:
            raise error(_EINVAL, f"{self.name}: arguments must be a list")
        checks = self._checks
        lo = self._required
        if not lo <= len(args) <= len(checks):
            hi = len(checks)
            want = f"{lo}" if lo == hi else f"{lo} to {hi}"
            raise error(_EINVAL, f"{self.name}: takes {want} arguments, got {len(args)}")
        for i, value in enumerate(args):
            kinds, none, elems = checks[i]
            if kinds is None:
                continue
            t = type(value)
            if t not in kinds:
                if value is None and (none or i >= lo):
                    continue
                raise error(_EINVAL, f"{self.name}: argument {i} ({self._fields[i]}) has "
                                     f"type {t.__name__}")
            if t is int:
                if not _INT_MIN <= value < _INT_END:
                    raise error(_EINVAL, f"{self.name}: argument {i} ({self._fields[i]}) out "
                                         "of range")
            elif elems is not None:
                for v in value:
                    te = type(v)
                    if te not in elems or (te is int and not _INT_MIN <= v < _INT_END):
                        raise error(_EINVAL, f"{self.name}: argument {i} ({self._fields[i]}) "
                                             f"holds a bad {te.__name__}")
        return args

    def decode(self, raw: object):
        """The answer as its response record; ProtocolError if it does not have that shape."""
        decode = self._decode
        if decode is not None:
            try:
                return decode(raw)
            except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
                raise ProtocolError(f"malformed answer to {self.name}: {e}") from None
        plain = self._plain
        if plain is not None:
            kinds, none, elems = plain
            if kinds is not None and type(raw) not in kinds and not (raw is None and none):
                raise ProtocolError(f"malformed answer to {self.name}: "
                                    f"{type(raw).__name__}")
            if elems is not None and type(raw) is list:  # list[bytes], list[int], ...
                for v in raw:
                    if type(v) not in elems:
                        raise ProtocolError(f"malformed answer to {self.name}: a "
                                            f"{type(v).__name__} in the list")
        return raw

    def __repr__(self) -> str:
        return f"Method({self.id}, {self.name!r})"


class Defer(Exception):
    """Raised by an inline handler that cannot answer without waiting, or given as the error
    that settles its ``Later``: the request is then run by the async handler in a task of its
    own."""


class Later:
    """Returned by an inline handler whose answer comes from a callback, such as a write queued
    to the next group commit: the server sends the answer from ``settle`` with no task of its
    own per request (dropping a task, a cancel scope and an event per create made creates
    1.3-1.4x faster on one shard)."""

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


@dataclass(frozen=True)
class Handler:
    """How a server answers one method, called with the request record's fields in order.

    ``now`` is a plain function the request loop calls inline (saving a task and a scheduler
    pass; most metadata reads answer in microseconds): it answers at once, returns a ``Later``,
    or raises ``Defer`` to hand the request to ``run``, an async function run in a task of its
    own (``payload=`` added for payload methods). Methods declared ``inline`` must have ``now``;
    the others must have ``run`` and no ``now``.
    """

    run: Callable | None = None
    now: Callable | None = None
    recycles: bool = False
    """A payload method whose ``run`` keeps no reference to its payload once it has returned
    (not raised): the server receives payloads into buffers it reuses (``PayloadBuffers``)."""


@dataclass(frozen=True, eq=False)
class Bound:
    """A method declaration with its handler: what the request loop looks up per request."""

    spec: Method
    run: Callable | None
    now: Callable | None
    recycles: bool = False


class PayloadBuffers:
    """Receive buffers for large payloads, reused from one request to the next.

    Fresh memory costs more than the bytes it holds: a new buffer of a few MiB is faulted in
    and zeroed by the kernel page by page (on a VM that gives freed memory back to its host,
    each page also faults in the host; docs/perf.md, "Fresh memory"). A storage node receiving
    4 MiB chunks spent a tenth of its CPU there. A buffer comes back only after its handler
    returned normally (``Handler.recycles``): one cancelled or failed may still have it in use
    (a put queued to the group commit), so it is dropped instead.
    """

    SMALLEST = 64 << 10
    """Smaller payloads come from the allocator's warm heap anyway."""
    ROUND = 1 << 20
    KEEP = 64 << 20
    """Bytes of idle buffers kept at most."""

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._kept = 0
        self.stats = {"reused": 0, "allocated": 0}

    def take(self, n: int) -> memoryview | None:
        """A view of ``n`` bytes of a reused buffer (one at most twice as large), or of a new
        one; None below ``SMALLEST`` (let the frame reader allocate)."""
        if n < self.SMALLEST:
            return None
        best = None
        for i, buf in enumerate(self._free):
            if n <= len(buf) <= 2 * n and (best is None or len(buf) < len(self._free[best])):
                best = i
        if best is not None:
            buf = self._free.pop(best)
            self._kept -= len(buf)
            self.stats["reused"] += 1
        else:
            buf = receive_buffer(-(-n // self.ROUND) * self.ROUND)
            self.stats["allocated"] += 1
        return memoryview(buf)[:n]

    def give(self, view: memoryview) -> None:
        """``view`` (from ``take``) is no longer used by anyone."""
        buf = view.obj
        try:
            view.release()
        except BufferError:  # something still holds a buffer of it: not ours to reuse
            return
        if not isinstance(buf, bytearray) or self._kept + len(buf) > self.KEEP:
            return
        self._free.append(buf)
        self._kept += len(buf)


@dataclass
class Service:
    """What a server offers: a role name, its declared methods and a handler for each one."""

    role: str
    methods: Mapping[str, Method]
    handlers: Mapping[Method, Handler]
    table: dict = field(init=False)
    """Bound methods by wire id, and by name (for hand-written frames and tools)."""
    requests: dict[str, int] = field(init=False)
    """Requests received, by method (for metrics)."""
    errors: dict[str, int] = field(init=False)
    """Requests answered with an error, by errno name."""
    buffers: PayloadBuffers = field(init=False)
    """Reused receive buffers of the methods whose handlers recycle their payloads."""

    def count_error(self, err: JPFSError) -> None:
        """Count one error answer under its errno name (``errors``, for metrics)."""
        name = errno_name(err.errno)
        self.errors[name] = self.errors.get(name, 0) + 1

    def __post_init__(self):
        self.requests = dict.fromkeys(self.methods, 0)
        self.errors = {}
        self.buffers = PayloadBuffers()
        declared = set(self.methods.values())
        extra = [m.name for m in self.handlers if m not in declared]
        if extra:
            raise TypeError(f"{self.role}: handlers for undeclared methods {extra}")
        self.table = {}
        for spec in self.methods.values():
            h = self.handlers.get(spec)
            if h is None:
                raise TypeError(f"{self.role}: no handler for {spec.name}")
            if spec.inline and h.now is None:
                raise TypeError(f"{self.role}: {spec.name} is declared inline but has no `now`")
            if not spec.inline and (h.now is not None or h.run is None):
                raise TypeError(f"{self.role}: {spec.name} is not inline: give `run` only")
            if spec.payload and spec.inline:
                raise TypeError(f"{self.role}: payload method {spec.name} cannot be inline")
            if h.recycles and not spec.payload:
                raise TypeError(f"{self.role}: {spec.name} has no payload to recycle")
            bound = Bound(spec, h.run, h.now, h.recycles)
            self.table[spec.id] = bound
            self.table[spec.name] = bound

    def lookup(self, method: object) -> Bound | None:
        """The bound method a request names (its id, or its name); None for anything else."""
        t = type(method)
        if t is int or t is str:  # exact types: True must not find method 1
            return self.table.get(method)
        return None


def method_table(*methods: Method) -> dict[str, Method]:
    """Methods by name; ids and names must be unique."""
    table = {m.name: m for m in methods}
    if len(table) != len(methods) or len({m.id for m in methods}) != len(methods):
        raise ValueError("duplicate method names or ids")
    return table


def as_error(exc: BaseException) -> JPFSError | None:
    """JPFSError for the errors a handler may raise on bad input; None for anything else."""
    if isinstance(exc, JPFSError):
        return exc
    if isinstance(exc, (TypeError, ValueError, OverflowError, UnicodeError)):
        return error(_EINVAL, f"invalid argument: {exc}")
    return None


__all__: Sequence[str] = ["Bound", "Defer", "Handler", "Later", "Method", "Reply", "Service",
                          "as_error", "method_table"]
