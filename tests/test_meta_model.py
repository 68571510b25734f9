"""A randomized model test: long sequences of namespace operations run against a real 3-shard
cluster and against a small in-memory model of POSIX, compared after every step."""

from __future__ import annotations

import errno
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

NAMES = ["a", "b", "c", "d"]


class Model:
    """path -> ("dir", None) | ("file", identity) | ("link", target), relative to a root dir."""

    def __init__(self):
        self.nodes: dict[str, tuple[str, object]] = {"": ("dir", None)}
        self.next_id = 0

    def kind(self, p):
        return self.nodes.get(p, (None,))[0]

    def children(self, p):
        pre = p + "/" if p else ""
        return [q for q in self.nodes if q.startswith(pre) and q != p and "/" not in q[len(pre):]]

    def dirs(self):
        return [p for p, (k, _) in self.nodes.items() if k == "dir"]

    def _parent_ok(self, p):
        """The error resolving ``p``'s parent: the first missing or non-directory component
        decides; every symlink here dangles, so following one finds nothing."""
        head = p.rpartition("/")[0]
        parts = head.split("/") if head else []
        for i in range(len(parts)):
            k = self.kind("/".join(parts[:i + 1]))
            if k is None or k == "link":
                return errno.ENOENT
            if k != "dir":
                return errno.ENOTDIR
        return None

    def mkdir(self, p):
        err = self._parent_ok(p) or (errno.EEXIST if p in self.nodes else None)
        if err is None:
            self.nodes[p] = ("dir", None)
        return err

    def create(self, p):
        err = self._parent_ok(p) or (errno.EEXIST if p in self.nodes else None)
        if err is None:
            self.next_id += 1
            self.nodes[p] = ("file", self.next_id)
        return err

    def symlink(self, p):
        err = self._parent_ok(p) or (errno.EEXIST if p in self.nodes else None)
        if err is None:
            self.nodes[p] = ("link", "nowhere")
        return err

    def link(self, src, dst):
        k = self.kind(src)
        if k is None:
            return self._parent_ok(src) or errno.ENOENT
        # Linux checks the new name (ENOTDIR, ENOENT, EEXIST) before refusing a directory
        err = self._parent_ok(dst) or (errno.EEXIST if dst in self.nodes else None)
        if err is None and k == "dir":
            return errno.EPERM
        if err is None:
            self.nodes[dst] = self.nodes[src]
        return err

    def unlink(self, p):
        k = self.kind(p)
        if k is None:
            return self._parent_ok(p) or errno.ENOENT
        if k == "dir":
            return errno.EISDIR
        del self.nodes[p]
        return None

    def rmdir(self, p):
        k = self.kind(p)
        if k is None:
            return self._parent_ok(p) or errno.ENOENT
        if k != "dir":
            return errno.ENOTDIR
        if self.children(p):
            return errno.ENOTEMPTY
        del self.nodes[p]
        return None

    def rename(self, src, dst):
        # both parents are resolved before the source is looked up, as rename(2) does
        err = self._parent_ok(src) or self._parent_ok(dst)
        if err:
            return err
        if self.kind(src) is None:
            return errno.ENOENT
        if src == dst:
            return None
        s, d = self.nodes[src], self.nodes.get(dst)
        if d is not None and s[0] == "file" and d == s:
            return None  # two links to one file: nothing happens
        if d is not None:
            if s[0] == "dir" and d[0] != "dir":
                return errno.ENOTDIR
            if d[0] == "dir" and s[0] != "dir":
                return errno.EISDIR
        if s[0] == "dir" and (dst + "/").startswith(src + "/"):
            return errno.EINVAL
        if d is not None and d[0] == "dir" and self.children(dst):
            return errno.ENOTEMPTY
        moved = {q: v for q, v in self.nodes.items() if q == src or q.startswith(src + "/")}
        for q in [q for q in self.nodes if q == dst or q.startswith(dst + "/")]:
            del self.nodes[q]
        for q in moved:
            del self.nodes[q]
        for q, v in moved.items():
            self.nodes[dst + q[len(src):]] = v
        return None


@pytest.fixture(scope="module")
def machine_client(client):
    return client


@pytest.mark.slow
def test_namespace_matches_model(machine_client):
    client = machine_client

    class Namespace(RuleBasedStateMachine):
        @initialize()
        def setup(self):
            self.root = f"/model-{uuid.uuid4().hex[:8]}"
            client.mkdir(self.root)
            self.model = Model()

        def _real(self, p):
            return f"{self.root}/{p}" if p else self.root

        def _run(self, expected, fn, *args):
            try:
                fn(*args)
                got = None
            except OSError as e:
                got = e.errno
            assert got == expected, f"{fn.__name__}{args}: got {got}, model says {expected}"

        def _path(self, data, existing=True):
            pool = list(self.model.nodes) if existing else []
            parents = self.model.dirs() + [p for p in self.model.nodes if p][:2]
            fresh = [f"{p}/{n}" if p else n for p in parents for n in NAMES]
            return data.draw(st.sampled_from(sorted(set(pool + fresh) - {""})))

        @rule(data=st.data())
        def mkdir(self, data):
            p = self._path(data, existing=False)
            self._run(self.model.mkdir(p), client.mkdir, self._real(p))

        @rule(data=st.data())
        def create(self, data):
            p = self._path(data, existing=False)
            self._run(self.model.create(p), client.create, self._real(p))

        @rule(data=st.data())
        def symlink(self, data):
            p = self._path(data, existing=False)
            self._run(self.model.symlink(p), client.symlink, "nowhere", self._real(p))

        @rule(data=st.data())
        def link(self, data):
            src, dst = self._path(data), self._path(data, existing=False)
            self._run(self.model.link(src, dst), client.link, self._real(src), self._real(dst))

        @rule(data=st.data())
        def unlink(self, data):
            p = self._path(data)
            self._run(self.model.unlink(p), client.remove, self._real(p))

        @rule(data=st.data())
        def rmdir(self, data):
            p = self._path(data)
            self._run(self.model.rmdir(p), client.rmdir, self._real(p))

        @rule(data=st.data())
        def rename(self, data):
            src, dst = self._path(data), self._path(data, existing=data.draw(st.booleans()))
            self._run(self.model.rename(src, dst), client.rename, self._real(src),
                      self._real(dst))

        @invariant()
        def same_tree(self):
            if not hasattr(self, "model"):
                return
            seen: dict[str, tuple[str, object]] = {}
            inos: dict[int, object] = {}
            stack = [""]
            while stack:
                p = stack.pop()
                entries = client.scandir(self._real(p))
                subdirs = 0
                for e in entries:
                    q = f"{p}/{e.name}" if p else e.name
                    want = self.model.nodes.get(q)
                    assert want is not None, f"unexpected {q}"
                    if e.attr.is_dir:
                        subdirs += 1
                        stack.append(q)
                        seen[q] = ("dir", None)
                    elif e.attr.is_link:
                        seen[q] = ("link", "nowhere")
                    else:
                        # hard links: the same model identity <=> the same inode
                        ident = want[1]
                        assert inos.setdefault(e.attr.ino, ident) == ident
                        seen[q] = ("file", ident)
                        links = sum(1 for v in self.model.nodes.values() if v == want)
                        assert e.attr.nlink == links, f"{q}: nlink {e.attr.nlink} != {links}"
                assert client.stat(self._real(p)).nlink == 2 + subdirs, f"{p}: nlink"
            assert seen == {k: v for k, v in self.model.nodes.items() if k}

    Namespace.TestCase.settings = settings(
        max_examples=15, stateful_step_count=25, deadline=None,
        suppress_health_check=list(HealthCheck))
    Namespace.TestCase().runTest()
