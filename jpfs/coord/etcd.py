"""An etcd v3 client for trio, over etcd's JSON gateway (``POST /v3/...``, through httpx).

JPFS keeps what needs consensus (the cluster map, shard leader leases) in etcd rather than in a
protocol of its own. etcd's native API is gRPC; its gateway serves the same calls as JSON over
HTTP/1.1, which httpx speaks under trio, so no gRPC stack (and no unmaintained etcd binding) is
needed. Keys and values are base64 on the wire; revisions arrive as decimal strings.

Only what JPFS uses is here: get, prefix get, put, compare-and-swap put/delete, leases, watch.
Every call tries the endpoints in turn within ``timeout`` and fails with an ``EtcdError`` that
names them.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import trio

from ..errors import JPFSError

# httpx logs every request at INFO: a leader renewing its lease twice a second would fill the
# daemons' logs (and a mount's) with them
logging.getLogger("httpx").setLevel(logging.WARNING)


class EtcdError(JPFSError):
    """etcd could not be reached or refused a call."""


@dataclass(frozen=True)
class KV:
    """One key as etcd stores it."""

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class Event:
    """A change seen by a watch: ``kind`` is ``"put"`` or ``"delete"``."""

    kind: str
    kv: KV


def _b(x: str | bytes) -> bytes:
    return x.encode() if isinstance(x, str) else x


def _enc(x: str | bytes) -> str:
    return base64.b64encode(_b(x)).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end``)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


def _kv(d: dict) -> KV:
    return KV(key=base64.b64decode(d.get("key", "")),
              value=base64.b64decode(d.get("value", "")),
              mod_revision=int(d.get("mod_revision", 0)),
              create_revision=int(d.get("create_revision", 0)),
              lease=int(d.get("lease", 0)))


def _answer(endpoint: str, path: str, r: httpx.Response) -> dict:
    """The JSON of an answer to ``path``; EtcdError (EIO) for anything but HTTP 200."""
    if r.status_code != 200:
        raise EtcdError(errno.EIO, f"etcd at {endpoint} refused {path}: HTTP {r.status_code} "
                                   f"{r.text.strip()[:200]}")
    return r.json()


def _unanswered(endpoints: Sequence[str], last: Exception | None) -> EtcdError:
    """The error when no endpoint answered (``last``: the last endpoint's failure)."""
    kind = errno.ETIMEDOUT if isinstance(last, httpx.TimeoutException) else errno.EIO
    return EtcdError(kind, f"etcd did not answer at {', '.join(endpoints)} ({last!r}); is it "
                           "running? (`jpfs cluster status`)")


class Etcd:
    """Async access to an etcd cluster at ``endpoints`` (``http://HOST:PORT``)."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float = 2.0):
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout), trust_env=False)
        # the endpoint that answered last; a random start spreads clients over etcd's members
        self._first = random.randrange(len(self.endpoints))

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()

    async def __aenter__(self) -> Etcd:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path`` on the first endpoint that answers."""
        last: Exception | None = None
        n = len(self.endpoints)
        for k in range(n):
            i = (self._first + k) % n
            try:
                r = await self._http.post(self.endpoints[i] + path, json=body)
            except httpx.HTTPError as e:
                last = e
                continue
            self._first = i
            return _answer(self.endpoints[i], path, r)
        raise _unanswered(self.endpoints, last)

    # ---- keys
    async def get(self, key: str | bytes) -> KV | None:
        """The key's value and revisions, or None if it does not exist. Raises EtcdError (EIO,
        ETIMEDOUT) when no endpoint answers."""
        got = await self._call("/v3/kv/range", {"key": _enc(key)})
        kvs = got.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str | bytes) -> list[KV]:
        """Every key that starts with ``prefix``, in key order."""
        p = _b(prefix)
        got = await self._call("/v3/kv/range", {"key": _enc(p), "range_end": _enc(_prefix_end(p))})
        return [_kv(d) for d in got.get("kvs") or []]

    async def put(self, key: str | bytes, value: bytes, *, lease: int = 0) -> int:
        """Store ``value``; returns the new revision."""
        body: dict = {"key": _enc(key), "value": _enc(value)}
        if lease:
            body["lease"] = str(lease)
        got = await self._call("/v3/kv/put", body)
        return int(got["header"]["revision"])

    async def delete(self, key: str | bytes) -> None:
        """Delete ``key`` (nothing happens if it does not exist)."""
        await self._call("/v3/kv/deleterange", {"key": _enc(key)})

    async def _txn_if(self, key: str | bytes, mod_revision: int, op: dict) -> bool:
        # mod_revision 0 = "the key does not exist": etcd compares create_revision == 0 then.
        target = "MOD" if mod_revision else "CREATE"
        field = "mod_revision" if mod_revision else "create_revision"
        compare = {"key": _enc(key), "result": "EQUAL", "target": target,
                   field: str(mod_revision)}
        got = await self._call("/v3/kv/txn", {"compare": [compare], "success": [op]})
        return bool(got.get("succeeded"))

    async def put_if(self, key: str | bytes, value: bytes, *, mod_revision: int,
                     lease: int = 0) -> bool:
        """Compare-and-swap: store ``value`` only if the key's ``mod_revision`` is the one given
        (0: only if the key does not exist)."""
        put: dict = {"key": _enc(key), "value": _enc(value)}
        if lease:
            put["lease"] = str(lease)
        return await self._txn_if(key, mod_revision, {"request_put": put})

    async def delete_if(self, key: str | bytes, *, mod_revision: int) -> bool:
        """Compare-and-delete: delete the key only if its ``mod_revision`` is the one given; whether
        it was deleted."""
        return await self._txn_if(key, mod_revision,
                                  {"request_delete_range": {"key": _enc(key)}})

    # ---- leases
    async def grant(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (rounded, at least 1); returns its id. EtcdError (EIO) if
        etcd refuses it."""
        got = await self._call("/v3/lease/grant", {"TTL": str(max(1, round(ttl)))})
        if got.get("error"):
            raise EtcdError(errno.EIO, f"etcd refused a lease: {got['error']}")
        return int(got["ID"])

    async def keepalive(self, lease: int) -> float:
        """Renew ``lease``; the seconds it has left, 0.0 if it is gone."""
        got = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return float(got.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """End ``lease`` now: the keys attached to it are deleted."""
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    # ---- watches
    @asynccontextmanager
    async def watch(self, key: str | bytes, *, start_revision: int = 0, prefix: bool = False
                    ) -> AsyncIterator[AsyncIterator[list[Event]]]:
        """Changes to ``key`` (or every key under it, ``prefix``) from ``start_revision`` on,
        as batches of events, for as long as the context is open.

        A broken stream raises ``EtcdError``; the caller resumes from the revision after the
        last one it saw.
        """
        create: dict = {"key": _enc(key)}
        if start_revision:
            create["start_revision"] = str(start_revision)
        if prefix:
            create["range_end"] = _enc(_prefix_end(_b(key)))
        url = self.endpoints[self._first] + "/v3/watch"
        timeout = httpx.Timeout(self.timeout, read=None)  # a quiet key is not a failure
        try:
            async with self._http.stream("POST", url, json={"create_request": create},
                                         timeout=timeout) as r:
                if r.status_code != 200:
                    raise EtcdError(errno.EIO, f"etcd at {url} refused a watch: "
                                               f"HTTP {r.status_code}")
                yield _events(r.aiter_lines(), url)
        except httpx.HTTPError as e:
            raise EtcdError(errno.EIO, f"etcd watch at {url} broke: {e!r}") from None


async def _events(lines: AsyncIterator[str], url: str) -> AsyncIterator[list[Event]]:
    try:
        async for line in lines:
            if not line.strip():
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise EtcdError(errno.EIO, f"etcd watch at {url}: {msg['error']}")
            result = msg.get("result", {})
            if result.get("canceled"):
                raise EtcdError(errno.EIO, f"etcd cancelled the watch at {url}: "
                                           f"{result.get('cancel_reason', '')}")
            events = [Event("delete" if e.get("type") == "DELETE" else "put", _kv(e["kv"]))
                      for e in result.get("events") or []]
            if events:
                yield events
    except httpx.HTTPError as e:
        raise EtcdError(errno.EIO, f"etcd watch at {url} broke: {e!r}") from None


async def wait_ready(endpoints: Sequence[str], deadline: float) -> None:
    """Return once etcd answers (a freshly started local etcd takes about a second)."""
    async with Etcd(endpoints, timeout=1.0) as etcd:
        with trio.move_on_after(deadline):
            while True:
                try:
                    await etcd.get(b"/jpfs/")
                    return
                except EtcdError:
                    await trio.sleep(0.05)
    raise EtcdError(errno.ETIMEDOUT, f"etcd did not come up at {', '.join(endpoints)} within "
                                     f"{deadline:.0f} s")


class LeaseKeepalive:
    """Blocking renewals of one lease, for a thread of its own (a leader's renewals must not
    wait behind its event loop's work; see ``jpfs_daemon.meta.renewal``). One keep-alive
    HTTP connection, the endpoints tried in turn as ``Etcd`` does."""

    def __init__(self, endpoints: Sequence[str], lease: int):
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.lease = lease
        self._http = httpx.Client(trust_env=False)
        self._first = random.randrange(len(self.endpoints))

    def renew(self, timeout: float) -> float:
        """Renew the lease; the seconds it has left (0.0: it is gone). EtcdError when no
        endpoint answered within ``timeout`` seconds."""
        last: Exception | None = None
        n = len(self.endpoints)
        for k in range(n):
            i = (self._first + k) % n
            try:
                r = self._http.post(self.endpoints[i] + "/v3/lease/keepalive",
                                    json={"ID": str(self.lease)}, timeout=timeout)
            except httpx.HTTPError as e:
                last = e
                continue
            self._first = i
            got = _answer(self.endpoints[i], "/v3/lease/keepalive", r)
            return float(got.get("result", {}).get("TTL", 0))
        raise _unanswered(self.endpoints, last)

    def close(self) -> None:
        """Close the HTTP connection."""
        self._http.close()
