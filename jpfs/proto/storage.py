"""The storage service's methods, and the wire shapes of their arguments and answers.

A storage node keeps immutable *blobs*, each named by a random 128-bit id chosen by the writer.
It knows nothing of files: the metadata service records which blobs (and which nodes) make up a
file. Every method is safe to repeat: re-putting a blob id with the same bytes is a no-op, so a
client may retry any call after a lost connection.

Wire shapes (msgpack; ids are 16-byte ``bytes``):

``put_blobs([[id, length, xxh], ...])`` + payload (the blobs back to back, in list order)
    -> ``[stored, already_present]``. The whole batch is stored durably (data fsynced, then one
    index transaction) or not at all. ``xxh`` is the xxh3-64 of each blob; a mismatch fails the
    batch with EIO (corrupted in transit); an id already stored with other bytes fails it with
    EEXIST.
``get_blobs([id, ...])`` -> ``[status, ...]`` + payload: the found blobs back to back in request
    order. ``status`` is ``[length, xxh]`` for a found blob and an errno name (``"ENOENT"``,
    ``"EIO"``) for one that is not served.
``delete_blobs([id, ...])`` -> number of blobs removed (unknown ids are ignored).
``list_blobs(after, limit)`` -> ``[[id, created], ...]``: ids greater than ``after`` in byte
    order, with their creation time (seconds since the epoch); an empty list at the end.
``compact(min_dead_ratio)`` -> ``CompactSummary.to_wire()``: a map of what was done
    (``{"volumes_compacted": n, "volumes_written": n, "blobs_moved": n, "bytes_reclaimed": n,
    "corrupt_blobs": n}``).
``stats()`` -> ``Stats.to_wire()``: a map of the node's counters, one key per field of
    ``Stats`` (``STATS_KEYS``).
``scrub_status()`` -> ``ScrubStatus.to_wire()``: a map of the scrubber's progress, one key per
    field of ``ScrubStatus`` (``SCRUB_KEYS``).
``scrub_start()`` -> the same, after starting a pass now if none runs (EINVAL when scrubbing
    is off on the node, ``--scrub-rate 0``).
``bad_blobs(after, limit)`` -> ``[[id, length, xxh, found, reason], ...]``: blobs the scrubber
    found bad (the node refuses to serve them: ``"EIO"`` in ``get_blobs``), ids greater than
    ``after``, with the length and checksum their index records. A ``put_blobs`` of such an id
    with that length and checksum replaces the bad copy (it counts as stored) and clears it.
``pull_blobs(source, [[id, length, xxh], ...])`` -> ``[stored, already_present, failures]``:
    this node fetches the blobs from the storage node at address ``source`` itself (node to
    node: a healer moving copies does not relay the bytes), checks each against ``length`` and
    ``xxh`` and stores those that verify as ``put_blobs`` would (a bad copy here is replaced);
    ``failures`` is ``[[id, reason], ...]`` for the blobs it could not get good bytes of.
``report_bad([id, ...])`` -> the number of those blobs newly marked bad: a client whose read
    failed its checksum tells the node, which re-reads those blobs from its volumes at once and
    marks the ones that fail (as its scrubber would), so the healer repairs them.
``host_info()`` -> ``HostInfo.to_wire()``: ``{"host": host_identity(), "volumes": path,
    "volumes_id": [dev, ino]}``, where the node runs and where its volume files are, for a
    client that may read them itself (short-circuit reads, ``jpfs.client.wire.shortcircuit``).

The answers of ``compact``, ``stats``, ``scrub_status``, ``scrub_start`` and ``host_info`` are
maps, not arrays: they are small and rare, operators read them as JSON, and a key added later
leaves older readers working (a reader takes the keys its record names and ignores the rest).
``locate_blobs([id, ...])`` -> ``[place, ...]``: per id, in request order, ``[volume, offset,
    length, xxh]`` (the blob's bytes in file ``volume_file(volume)`` of the volumes directory)
    or an errno name as in ``get_blobs``. Volume ids are never reused, and a volume's bytes
    never change once written (compaction writes a new volume and unlinks the old one), so a
    place stays true for as long as the reader holds the file open.
"""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

from ..errors import error
from ..rpc import Method, method_table
from .records import from_map as _from_map

BLOB_ID_BYTES = 16

MAX_BATCH_BLOBS = 65536
"""Most blob ids (or put entries) one request may name."""

MAX_PUT_BYTES = 256 << 20
"""Largest put payload a server accepts (a frame over this is refused before it is read)."""

MAX_GET_BYTES = 1 << 30
"""Largest get answer a server sends (the client's default frame limit)."""

MAX_LIST = 100_000
"""Most ids one ``list_blobs`` answer carries."""

# ---- request and response records --------------------------------------------------------------


class PutBlobsReq(NamedTuple):
    """``put_blobs``: the blobs whose bytes follow as the payload."""

    entries: list[list]
    """``[id, length, xxh]`` per blob, in payload order."""


class IdsReq(NamedTuple):
    """``get_blobs``, ``delete_blobs``: blobs by id."""

    ids: list
    """16-byte blob ids, at most MAX_BATCH_BLOBS (checked by ``check_ids``)."""


class ListBlobsReq(NamedTuple):
    """``list_blobs``: a page of at most ``limit`` ids after ``after`` (gc's sweep)."""

    after: bytes
    limit: int


class CompactReq(NamedTuple):
    """``compact``: rewrite volumes whose dead share is at least ``min_dead_ratio``."""

    min_dead_ratio: float


class NoArgs(NamedTuple):
    """``stats``: a method without arguments."""


class BadBlobsReq(NamedTuple):
    """``bad_blobs``: a page of at most ``limit`` bad blobs after id ``after`` (the repair)."""

    after: bytes
    limit: int


class PullBlobsReq(NamedTuple):
    """``pull_blobs``: fetch ``entries`` from the storage node at ``source`` and store them."""

    source: str
    """HOST:PORT of the node that holds good copies."""
    entries: list[list]
    """``[id, length, xxh]`` per blob."""


class PullResult(NamedTuple):
    """``pull_blobs``: stored, already present, and ``(id, reason)`` for each blob not stored.
    Wire: ``[stored, already_present, [[id, reason], ...]]``."""

    stored: int
    already_present: int
    failures: list[tuple[bytes, str]]

    @classmethod
    def from_wire(cls, w: list) -> PullResult:
        """The result from ``[stored, already_present, [[id, reason], ...]]``."""
        stored, present, failures = w
        return cls(stored, present, [(bid, why) for bid, why in failures])


class PutResult(NamedTuple):
    """``put_blobs``: blobs newly stored and blobs that were there already.
    Wire: ``[stored, already_present]``."""

    stored: int
    already_present: int

    @classmethod
    def from_wire(cls, w: list) -> PutResult:
        """The result from ``[stored, already_present]``."""
        stored, present = w
        return cls(stored, present)


class BlobStatuses:
    """``get_blobs``: per id, in request order, ``[length, xxh]`` for a blob that follows in
    the payload, or the errno name (``"ENOENT"``, ``"EIO"``) of why it is not served. Decoded
    as is (no object per blob: a batch carries thousands); ``found`` tells the two apart."""

    @staticmethod
    def from_wire(w: list) -> list:
        """The statuses as sent (a list; TypeError otherwise): tell them apart with ``found``."""
        if type(w) is not list:
            raise TypeError("get_blobs statuses must be a list")
        return w

    @staticmethod
    def found(status: object) -> bool:
        """Whether ``status`` is ``[length, xxh]`` (ints) rather than an errno name."""
        return type(status) is list and len(status) == 2 and type(status[0]) is int \
            and type(status[1]) is int


class BlobPage:
    """``list_blobs``: ``(id, created)`` pairs in id order; empty at the end.
    Wire: ``[[id, created], ...]``."""

    @staticmethod
    def from_wire(w: list) -> list[tuple[bytes, float]]:
        """The page as ``(id, created)`` tuples."""
        return [(bid, created) for bid, created in w]


class BadPage:
    """``bad_blobs``: ``(id, length, xxh, found, reason)`` in id order; empty at the end."""

    @staticmethod
    def from_wire(w: list) -> list[tuple[bytes, int, int, float, str]]:
        """The page as ``(id, length, xxh, found, reason)`` tuples."""
        return [(bid, length, xxh, found, reason) for bid, length, xxh, found, reason in w]


class BlobPlaces:
    """``locate_blobs``: per id, in request order, ``[volume, offset, length, xxh]`` or an
    errno name; ``found`` tells the two apart."""

    @staticmethod
    def from_wire(w: list) -> list:
        """The places as sent (a list; TypeError otherwise): tell them apart with ``found``."""
        if type(w) is not list:
            raise TypeError("locate_blobs places must be a list")
        return w

    @staticmethod
    def found(place: object) -> bool:
        """Whether ``place`` is ``[volume, offset, length, xxh]`` (non-negative ints), not an errno
        name."""
        return type(place) is list and len(place) == 4 and all(type(x) is int for x in place) \
            and min(place) >= 0


class CompactSummary(NamedTuple):
    """``compact``: what one compaction did. Wire: a map, one key per field."""

    volumes_compacted: int
    """Old volumes rewritten (and unlinked)."""
    volumes_written: int
    """New volumes their live blobs went into."""
    blobs_moved: int
    bytes_reclaimed: int
    corrupt_blobs: int
    """Blobs whose bytes failed their checksum while being moved (marked bad, not moved)."""

    @classmethod
    def from_wire(cls, w: dict) -> CompactSummary:
        """The summary from its map."""
        return _from_map(cls, w)

    def to_wire(self) -> dict:
        """The map the server sends."""
        return self._asdict()

    def as_dict(self) -> dict:
        """The summary as JSON reports print it (the wire's map)."""
        return self._asdict()


class Stats(NamedTuple):
    """``stats``: a node's usage and counters (counters count since the daemon started, except
    the scrub totals). Wire: a map, one key per field, in this order."""

    node: int
    """This server's index in the cluster file."""
    volumes: int
    """Volume files."""
    blobs: int
    """Live blobs."""
    bytes_used: int
    """Bytes in volume files (live + dead)."""
    live_bytes: int
    """Bytes of live blobs."""
    dead_bytes: int
    """Bytes of deleted (or superseded) blobs not yet compacted away."""
    disk_free: int
    """Free bytes on the data directory's filesystem (for statfs)."""
    disk_total: int
    """Size of that filesystem."""
    disk_id: str
    """``host:device`` of that filesystem: nodes sharing a disk count it once."""
    bad_blobs: int
    """Blobs the scrubber found bad and no re-put has replaced yet."""
    puts: int
    """put_blobs requests stored."""
    blobs_put: int
    """Blobs newly stored."""
    gets: int
    """get_blobs requests answered."""
    blobs_sent: int
    """Blobs sent by get_blobs."""
    segments_sent: int
    """Sendfile segments those were sent as (coalescing: fewer than blobs)."""
    bytes_sent: int
    """Payload bytes sent by get_blobs."""
    cold_warmups: int
    """get_blobs answers whose pages were read in a worker thread first."""
    compactions: int
    """Volumes rewritten by compact."""
    locates: int
    """locate_blobs requests (clients on this host reading volumes themselves)."""
    blobs_located: int
    """Blobs those named."""
    pulls: int
    """pull_blobs requests served (copies fetched from another node)."""
    blobs_pulled: int
    """Blobs newly stored by them."""
    bytes_pulled: int
    """Bytes fetched by them."""
    reports_bad: int
    """report_bad requests (clients that saw a checksum mismatch)."""
    commits: int
    """Group commits (each one fsync of data + one index transaction)."""
    scrub_passes: int
    """Full scrub passes completed."""
    scrub_bytes: int
    """Bytes the scrubber verified, over all passes."""
    scrub_bad_found: int
    """Bad blobs the scrubber found, over all passes."""
    scrub_repaired: int
    """Bad copies replaced by a re-put (a repair), ever."""

    @classmethod
    def from_wire(cls, w: dict) -> Stats:
        """The stats from their map."""
        return _from_map(cls, w)

    def to_wire(self) -> dict:
        """The map the server sends (also the daemon's metrics snapshot)."""
        return self._asdict()

    def as_dict(self) -> dict:
        """The stats as JSON reports print them (the wire's map)."""
        return self._asdict()


class ScrubStatus(NamedTuple):
    """``scrub_status`` and ``scrub_start``: the scrubber's progress. Wire: a map, one key per
    field, in this order."""

    enabled: bool
    """False with --scrub-rate 0."""
    state: str
    """``"scrubbing"``, ``"waiting"`` (for the next pass) or ``"off"``."""
    rate_limit: float
    """Bytes/s the scrubber reads at most."""
    pause: float
    """Seconds between the end of a pass and the start of the next."""
    passes: int
    """Full passes completed."""
    pass_started: float | None
    """When the current (or last) pass began (seconds since the epoch)."""
    pass_bytes: int
    """Bytes verified in the current pass."""
    pass_blobs: int
    """Blobs verified in the current pass."""
    pass_total: int
    """Live bytes when the current pass began (its length)."""
    progress: float
    """pass_bytes / pass_total, 0 to 1 (1 while waiting)."""
    position: list | None
    """``[volume, offset]`` the pass has reached, or None."""
    bytes_per_s: float
    """The current pass's read rate, pauses for pacing included."""
    last_finished: float | None
    """When the last full pass ended, or None."""
    next_pass: float | None
    """When the next pass starts (while waiting), or None."""
    bytes_verified: int
    """Over all passes."""
    blobs_verified: int
    """Over all passes."""
    bad_found: int
    """Bad blobs found, over all passes."""
    bad_blobs: int
    """Bad blobs not yet replaced."""
    repaired: int
    """Bad copies replaced by a re-put, ever."""

    @classmethod
    def from_wire(cls, w: dict) -> ScrubStatus:
        """The status from its map."""
        return _from_map(cls, w)

    def to_wire(self) -> dict:
        """The map the server sends."""
        return self._asdict()

    def as_dict(self) -> dict:
        """The status as JSON reports print it (the wire's map)."""
        return self._asdict()


class HostInfo(NamedTuple):
    """``host_info``: where a node runs and keeps its volume files (short-circuit reads).
    Wire: ``{"host": [boot id, netns], "volumes": path, "volumes_id": [dev, ino]}``."""

    host: list
    """``host_identity()`` of the node's process."""
    volumes: str
    """The volumes directory's absolute path."""
    volumes_id: list
    """``[st_dev, st_ino]`` of that directory (the same directory, not a look-alike)."""

    @classmethod
    def from_wire(cls, w: dict) -> HostInfo:
        """The answer from its map; TypeError unless each value has its shape."""
        info = _from_map(cls, w)
        if type(info.host) is not list or len(info.host) != 2 or type(info.volumes) is not str \
                or type(info.volumes_id) is not list or len(info.volumes_id) != 2:
            raise TypeError("host_info: host, volumes or volumes_id of the wrong shape")
        return info

    def to_wire(self) -> dict:
        """The map the server sends."""
        return self._asdict()


def volume_file(vol: int) -> str:
    """The name of volume ``vol``'s file in a node's volumes directory."""
    return f"v{vol:08d}.vol"


def host_identity() -> list:
    """``[boot id, network namespace inode]`` of this process: two processes that agree run
    on one kernel and reach the same loopback (a node in another namespace, as `jpfs bench
    --hosts` simulates remote hosts, counts as remote)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ["", 0]
    return [boot, netns]


# ---- the methods (ids are stable: never reuse one) ---------------------------------------------

PUT_BLOBS = Method(1, "put_blobs", PutBlobsReq, PutResult, idempotent=True, payload=True)
GET_BLOBS = Method(2, "get_blobs", IdsReq, BlobStatuses, idempotent=True)
DELETE_BLOBS = Method(3, "delete_blobs", IdsReq, int, idempotent=True)
LIST_BLOBS = Method(4, "list_blobs", ListBlobsReq, BlobPage, idempotent=True)
COMPACT = Method(5, "compact", CompactReq, CompactSummary, idempotent=True)
STATS = Method(6, "stats", NoArgs, Stats, idempotent=True)
SCRUB_STATUS = Method(7, "scrub_status", NoArgs, ScrubStatus, idempotent=True)
SCRUB_START = Method(8, "scrub_start", NoArgs, ScrubStatus, idempotent=True)
BAD_BLOBS = Method(9, "bad_blobs", BadBlobsReq, BadPage, idempotent=True)
PULL_BLOBS = Method(10, "pull_blobs", PullBlobsReq, PullResult, idempotent=True)
REPORT_BAD = Method(11, "report_bad", IdsReq, int, idempotent=True)
HOST_INFO = Method(12, "host_info", NoArgs, HostInfo, idempotent=True)
LOCATE_BLOBS = Method(13, "locate_blobs", IdsReq, BlobPlaces, idempotent=True)

METHODS = method_table(PUT_BLOBS, GET_BLOBS, DELETE_BLOBS, LIST_BLOBS, COMPACT, STATS,
                       SCRUB_STATUS, SCRUB_START, BAD_BLOBS, PULL_BLOBS, REPORT_BAD, HOST_INFO,
                       LOCATE_BLOBS)
"""Every storage method by name."""

STATS_KEYS = Stats._fields
"""The keys of a ``stats`` answer, in order (``Stats`` says what each counts)."""

SCRUB_KEYS = ScrubStatus._fields
"""The keys of a ``scrub_status`` answer, in order (``ScrubStatus`` says what each means)."""


def check_id(value: object) -> bytes:
    """Raise EINVAL unless ``value`` is a 16-byte blob id."""
    if not isinstance(value, bytes) or len(value) != BLOB_ID_BYTES:
        raise error(errno.EINVAL, f"a blob id must be {BLOB_ID_BYTES} bytes")
    return value


def check_ids(values: list, what: str) -> list[bytes]:
    """Raise EINVAL/E2BIG unless ``values`` is a list of at most MAX_BATCH_BLOBS blob ids."""
    if len(values) > MAX_BATCH_BLOBS:
        raise error(errno.E2BIG, f"{what}: {len(values)} ids in one request "
                                 f"(at most {MAX_BATCH_BLOBS})")
    n = BLOB_ID_BYTES
    if not all(type(v) is bytes and len(v) == n for v in values):
        for v in values:
            check_id(v)
    return values


def blob_name(blob: bytes) -> str:
    """A blob id as people and logs see it."""
    return blob.hex() if isinstance(blob, bytes) else repr(blob)
