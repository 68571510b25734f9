"""The cluster file: one TOML file that tells every process where everything is.

```toml
[cluster]
name = "jpfs"
secret_file = "secret"        # relative paths are relative to this file
replicas = 1
chunk_size = "4MiB"
peer_timeout = 1.5            # seconds a client waits for a daemon that does not answer

[[meta]]                       # one table per metadata shard, in shard order
address = "127.0.0.1:7301"
data = "meta-0"                # optional: where `jpfs cluster up` keeps this shard's LMDB

[[storage]]                    # one table per storage node, in node order
address = "127.0.0.1:7401"
data = "storage-0"
```

A cluster whose shape can change keeps it in etcd instead (the *cluster map*, see
``jpfs.coord.clustermap``); its file says only where etcd is, plus the secret:

```toml
[cluster]
name = "jpfs"
secret_file = "secret"
etcd = ["http://127.0.0.1:2379"]
```

``JPFS_CLUSTER`` names the default cluster file. Shard and node *indices* are what metadata records,
so addresses may change between restarts; an index never changes meaning: shards and nodes are only
ever appended, and a node that leaves keeps its index with the state ``removed``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tomllib
import urllib.error
import urllib.request
from base64 import b64decode, b64encode
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

DEFAULT_CHUNK_SIZE = 4 << 20
DEFAULT_PEER_TIMEOUT = 1.5
"""Seconds a client gives a daemon that does not answer (connect, handshake, a call that hears
nothing at all) before it fails over or gives up. A refused connection is not waited on."""
ENV_CLUSTER = "JPFS_CLUSTER"
DEFAULT_CLUSTER_PATHS = (
    "./jpfs-cluster/cluster.toml", "~/.jpfs/cluster.toml", "/etc/jpfs/cluster.toml"
)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``"4MiB"`` -> 4194304; ``"20G"`` -> 20 * 2**30 (sizes are binary, as `du -h` prints them)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (try 4MiB, 512K, 20G)")
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * (1 << (10 * " kmgtp".index(unit or " "))))


def format_size(n: float) -> str:
    """A byte count for humans: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def parse_address(text: str) -> tuple[str, int]:
    """``"127.0.0.1:7301"`` or ``"[::1]:7301"`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Server:
    """One daemon in the cluster file: where it listens, its data folder, its metrics port."""

    address: str
    data: str | None = None
    metrics: str | None = None
    """HOST:PORT where the daemon serves Prometheus metrics (optional)."""
    state: str = "active"
    """Storage nodes: ``active`` (takes new writes), ``draining`` (read, being emptied) or
    ``removed`` (gone: its copies no longer count)."""
    domain: str | None = None
    """Storage nodes: the failure domain (a host, a rack) whose loss takes the node with it;
    copies of a chunk go to distinct domains where there are enough. Default: the host of
    ``address``, so several daemons on one machine never hold every copy of a chunk."""

    @property
    def failure_domain(self) -> str:
        """The node's failure domain: ``domain`` if set, else the host of ``address``."""
        return self.domain or self.host_port[0]

    @property
    def host_port(self) -> tuple[str, int]:
        """``address`` split into host and port (``parse_address``)."""
        return parse_address(self.address)


@dataclass(frozen=True)
class Cluster:
    """A parsed cluster file."""

    meta: tuple[Server, ...]
    storage: tuple[Server, ...] = ()
    secret: bytes = field(default=b"", repr=False)
    replicas: int = 1
    chunk_size: int = DEFAULT_CHUNK_SIZE
    name: str = "jpfs"
    path: Path | None = None
    secret_file: str = "secret"
    peer_timeout: float = DEFAULT_PEER_TIMEOUT
    """Seconds to wait for a silent daemon (see ``DEFAULT_PEER_TIMEOUT``)."""
    etcd: tuple[str, ...] = ()
    """Where the cluster map is (etcd endpoints); empty for a static cluster file."""
    epoch: int = 0
    """The map's version (its etcd revision); 0 for a static cluster file."""
    meta_replicas: tuple[tuple[Server, ...], ...] = ()
    """Every copy of each shard (``meta_replicas[i][j]``); ``meta[i]`` is copy 0."""

    def __post_init__(self) -> None:
        if not self.meta_replicas:
            object.__setattr__(self, "meta_replicas", tuple((s,) for s in self.meta))

    @property
    def n_shards(self) -> int:
        """How many metadata shards there are (one per ``meta`` entry)."""
        return len(self.meta)

    @property
    def n_meta_replicas(self) -> int:
        """Copies per shard (the most any shard has)."""
        return max((len(r) for r in self.meta_replicas), default=1)

    @property
    def node_domains(self) -> tuple[str, ...]:
        """Each storage node's failure domain, by index (``Server.failure_domain``)."""
        return tuple(s.failure_domain for s in self.storage)

    @property
    def writable_nodes(self) -> tuple[int, ...]:
        """Indices of the storage nodes that take new writes (state ``active``)."""
        return tuple(i for i, s in enumerate(self.storage) if s.state == "active")

    @property
    def n_nodes(self) -> int:
        """How many storage nodes there are, whatever their state."""
        return len(self.storage)

    def data_dir(self, role: str, index: int, replica: int = 0) -> Path:
        """Where a daemon keeps its files (relative entries resolve next to the cluster file);
        ``replica`` picks a copy of a metadata shard."""
        server = self.meta_replicas[index][replica] if role == "meta" else self.storage[index]
        base = self.path.parent if self.path else Path.cwd()
        default = f"{role}-{index}" + (f"-r{replica}" if replica else "")
        return (base / (server.data or default)).resolve()

    def to_toml(self) -> str:
        """The cluster file's TOML text: the cluster table and each ``meta``/``storage`` server
        (copy 0 of each shard; the secret stays in ``secret_file``); for an etcd cluster, only where
        the map is."""
        if self.etcd:  # the shape lives in the map; the file says where the map is
            return tomli_w.dumps({"cluster": {"name": self.name, "secret_file": self.secret_file,
                                              "etcd": list(self.etcd)}})
        doc = {
            "cluster": {
                "name": self.name,
                "secret_file": self.secret_file,
                "replicas": self.replicas,
                "chunk_size": self.chunk_size,
                **({"peer_timeout": self.peer_timeout}
                   if self.peer_timeout != DEFAULT_PEER_TIMEOUT else {}),
            },
            "meta": [_server_table(s) for s in self.meta],
            "storage": [_server_table(s) for s in self.storage],
        }
        return tomli_w.dumps(doc)


def _server_table(s: Server) -> dict:
    return {"address": s.address, **({"data": s.data} if s.data else {}),
            **({"metrics": s.metrics} if s.metrics else {}),
            **({"domain": s.domain} if s.domain else {})}


# ---- the cluster map: the shape of a cluster kept in etcd (jpfs.coord.clustermap writes it)

MAP_VERSION = 1
NODE_STATES = ("active", "draining", "removed")


def map_key(name: str) -> str:
    """The etcd key of cluster ``name``'s map: one JSON document."""
    return f"/jpfs/{name}/map"


def map_document(cluster: Cluster) -> dict:
    """The map of ``cluster`` as stored in etcd, signed with the cluster secret (``mac``): the
    map tells every client where to send data, so one written without the secret (by anyone who
    can reach etcd) is refused, as a daemon refuses a connection without it."""
    doc: dict = {
        "version": MAP_VERSION,
        "replicas": cluster.replicas,
        "chunk_size": cluster.chunk_size,
        "peer_timeout": cluster.peer_timeout,
        "shards": [[_server_table(s) for s in copies] for copies in cluster.meta_replicas],
        "nodes": [{**_server_table(s), "state": s.state} for s in cluster.storage],
    }
    if cluster.secret:
        doc["mac"] = _map_mac(cluster.secret, doc)
    return doc


def _map_mac(secret: bytes, doc: dict) -> str:
    body = json.dumps({k: v for k, v in doc.items() if k != "mac"}, sort_keys=True,
                      separators=(",", ":")).encode()
    return hmac.new(secret, b"jpfs-map\0" + body, hashlib.sha256).hexdigest()


def from_map(doc: dict, base: Cluster, epoch: int) -> Cluster:
    """``base`` (name, secret, etcd, path) with the shape the map ``doc`` describes."""
    where = f"cluster map {map_key(base.name)}"
    if base.secret and not hmac.compare_digest(str(doc.get("mac", "")),
                                               _map_mac(base.secret, doc)):
        raise ValueError(f"{where} is not signed with this cluster's secret (a wrong secret "
                         "file, or a map written by something without it): refusing it")
    try:
        if doc.get("version") != MAP_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, this JPFS reads {MAP_VERSION}")
        shards = tuple(tuple(_map_server(t) for t in copies) for copies in doc["shards"])
        nodes = tuple(_map_server(t) for t in doc["nodes"])
        if not shards or not all(shards):
            raise ValueError("no metadata shards")
        for s in nodes:
            if s.state not in NODE_STATES:
                raise ValueError(f"storage node {s.address} has state {s.state!r}")
        return Cluster(
            meta=tuple(copies[0] for copies in shards), storage=nodes, secret=base.secret,
            replicas=int(doc["replicas"]), chunk_size=int(doc["chunk_size"]), name=base.name,
            path=base.path, secret_file=base.secret_file,
            peer_timeout=float(doc.get("peer_timeout", DEFAULT_PEER_TIMEOUT)), etcd=base.etcd,
            epoch=epoch, meta_replicas=shards)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where} is not valid: {e}") from None


def _map_server(t: dict) -> Server:
    parse_address(t["address"])
    return Server(address=t["address"], data=t.get("data"), metrics=t.get("metrics"),
                  state=t.get("state", "active"), domain=t.get("domain"))


def fetch_map(cluster: Cluster, timeout: float = 5.0) -> Cluster:
    """Read the map from etcd (blocking: for ``load``; running code follows the map with
    ``jpfs.coord.clustermap``)."""
    body = json.dumps({"key": b64encode(map_key(cluster.name).encode()).decode()}).encode()
    errors = []
    for endpoint in cluster.etcd:
        req = urllib.request.Request(endpoint.rstrip("/") + "/v3/kv/range", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                got = json.load(r)
        except (OSError, ValueError) as e:
            errors.append(f"{endpoint}: {getattr(e, 'reason', e)}")
            continue
        kvs = got.get("kvs") or []
        if not kvs:
            raise ValueError(f"{cluster.path}: etcd at {endpoint} has no map for cluster "
                             f"{cluster.name!r} (key {map_key(cluster.name)}); was it made by "
                             "`jpfs cluster up`?")
        doc = json.loads(b64decode(kvs[0]["value"]))
        return from_map(doc, cluster, int(kvs[0]["mod_revision"]))
    raise ValueError(f"{cluster.path}: cannot read the cluster map from etcd "
                     f"({'; '.join(errors)}); is etcd running? (`jpfs cluster up` starts a "
                     "local one)")


def load(path: str | os.PathLike | None = None) -> Cluster:
    """Read a cluster file (default: ``$JPFS_CLUSTER``, then the usual places)."""
    p = find_cluster_file(path)
    try:
        doc = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: not valid TOML: {e}") from None
    c = _check(p, "cluster", doc.get("cluster", {}), dict)
    for key, kinds in _CLUSTER_KEYS.items():
        if key in c:
            _check(p, f"cluster.{key}", c[key], kinds)
    etcd = tuple(c.get("etcd", ()))
    if etcd:
        return _load_mapped(p, c, etcd, doc)
    meta = tuple(_server(p, "meta", i, t) for i, t in enumerate(_servers(p, doc, "meta")))
    storage = tuple(_server(p, "storage", i, t)
                    for i, t in enumerate(_servers(p, doc, "storage")))
    if not meta:
        raise ValueError(f"{p}: no [[meta]] shards (add one table per shard: [[meta]] with "
                         'address = "HOST:PORT")')
    secret_file, secret = _secret(p, c)
    replicas = c.get("replicas", 1)
    if replicas < 1:
        raise ValueError(f"{p}: replicas must be at least 1")
    if storage and replicas > len(storage):
        raise ValueError(f"{p}: replicas = {replicas} but only {len(storage)} storage nodes")
    peer_timeout = float(c.get("peer_timeout", DEFAULT_PEER_TIMEOUT))
    if not 0 < peer_timeout <= 3600:
        raise ValueError(f"{p}: cluster.peer_timeout must be between 0 and 3600 seconds, not "
                         f"{c['peer_timeout']!r}")
    return Cluster(
        meta=meta,
        storage=storage,
        secret=secret,
        replicas=replicas,
        chunk_size=_chunk_size(p, c.get("chunk_size", DEFAULT_CHUNK_SIZE)),
        name=str(c.get("name", "jpfs")),
        path=p.resolve(),
        secret_file=secret_file,
        peer_timeout=peer_timeout,
    )


def _secret(p: Path, c: dict) -> tuple[str, bytes]:
    secret_file = c.get("secret_file", "secret")
    secret_path = (p.parent / secret_file).expanduser()
    try:
        return secret_file, secret_path.read_bytes().strip()
    except OSError as e:
        raise ValueError(f"{p}: cannot read the secret file {secret_path}: {e.strerror}") from None


def _load_mapped(p: Path, c: dict, etcd: tuple, doc: dict) -> Cluster:
    """A cluster file that names etcd: the shape comes from the map there."""
    for role in ("meta", "storage"):
        if role in doc:
            raise ValueError(f"{p}: [[{role}]] tables and cluster.etcd do not mix: a cluster "
                             "with a map keeps its shards and nodes there (`jpfs node list`)")
    for i, e in enumerate(etcd):
        _check(p, f"cluster.etcd[{i}]", e, str)
        if not e.startswith(("http://", "https://")):
            raise ValueError(f"{p}: cluster.etcd[{i}] must be a URL like "
                             f"http://127.0.0.1:2379, not {e!r}")
    secret_file, secret = _secret(p, c)
    base = Cluster(meta=(), secret=secret, name=str(c.get("name", "jpfs")), path=p.resolve(),
                   secret_file=secret_file, etcd=etcd)
    return fetch_map(base)


_CLUSTER_KEYS: dict[str, tuple[type, ...]] = {
    "name": (str,), "secret_file": (str,), "replicas": (int,), "chunk_size": (int, str),
    "peer_timeout": (float, int), "etcd": (list,),
}
_SERVER_KEYS = ("address", "data", "metrics", "domain")
_KIND = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
         list: "an array", dict: "a table"}


def _kind(value: object) -> str:
    return next((name for t, name in _KIND.items() if isinstance(value, t)), type(value).__name__)


def _check(path: Path, key: str, value, kinds: type | tuple[type, ...]):
    """``value`` if it has one of the TOML types ``kinds``; else an error naming ``key``."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        want = " or ".join(_KIND[k].split(" ", 1)[1] for k in kinds)
        raise ValueError(f"{path}: {key} must be {_KIND[kinds[0]].split(' ', 1)[0]} {want}, "
                         f"not {_kind(value)} ({value!r})")
    return value


def _servers(path: Path, doc: dict, role: str) -> list[dict]:
    """The ``[[meta]]``/``[[storage]]`` tables, each checked to be a table."""
    tables = doc.get(role, [])
    if not isinstance(tables, list):
        raise ValueError(f"{path}: {role} must be an array of tables, one [[{role}]] with "
                         f'address = "HOST:PORT" per {_ROLE[role]}, not {_kind(tables)} '
                         f"({tables!r})")
    for i, t in enumerate(tables):
        if not isinstance(t, dict):
            raise ValueError(f"{path}: {role}[{i}] must be a table with address = "
                             f'"HOST:PORT" (one [[{role}]] per {_ROLE[role]}), not '
                             f"{_kind(t)} ({t!r})")
    return tables


_ROLE = {"meta": "metadata shard", "storage": "storage node"}


def _chunk_size(path: Path, value: int | str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{path}: cluster.chunk_size: {e}") from None


def _server(path: Path, role: str, i: int, t: dict) -> Server:
    if "address" not in t:
        raise ValueError(f'{path}: {role}[{i}] has no address (add address = "HOST:PORT")')
    for key in _SERVER_KEYS:
        if key in t:
            _check(path, f"{role}[{i}].{key}", t[key], str)
    for key in ("address", "metrics"):
        if key in t:
            try:
                parse_address(t[key])
            except ValueError as e:
                raise ValueError(f"{path}: {role}[{i}].{key}: {e}") from None
    return Server(address=t["address"], data=t.get("data"), metrics=t.get("metrics"),
                  domain=t.get("domain"))


def find_cluster_file(path: str | os.PathLike | None = None) -> Path:
    """The cluster file to use: the argument, ``$JPFS_CLUSTER``, or the first default that exists.

    A directory means the ``cluster.toml`` inside it (what ``jpfs cluster up --dir`` writes).
    """
    candidates = [path] if path else ([os.environ[ENV_CLUSTER]] if os.environ.get(ENV_CLUSTER)
                                      else list(DEFAULT_CLUSTER_PATHS))
    for cand in candidates:
        p = Path(cand).expanduser()
        if p.is_dir():
            p = p / "cluster.toml"
        if p.is_file():
            return p
    if path or os.environ.get(ENV_CLUSTER):
        raise FileNotFoundError(f"no cluster file at {candidates[0]}")
    raise FileNotFoundError(
        "no cluster file: pass --cluster, set JPFS_CLUSTER, or start one with "
        "`jpfs cluster up --dir ./jpfs-cluster`"
    )


def write(cluster: Cluster, path: str | os.PathLike) -> None:
    """Write a cluster file atomically (readers never see half of it)."""
    p = Path(path)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(cluster.to_toml())
    os.replace(tmp, p)


def new_secret(path: str | os.PathLike) -> bytes:
    """Create a random cluster secret readable only by its owner."""
    secret = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return secret
