"""The import direction of docs/design.md, checked by reading every module's imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"jpfs": ROOT / "jpfs", "jpfs_daemon": ROOT / "daemon", "jpfs_bench": ROOT / "bench"}


def _modules():
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([pkg, *parts]), path, path.name == "__init__.py"


def _dynamic_target(node: ast.Call) -> str | None:
    """The module an ``importlib.import_module("x")``/``__import__("x")`` call names: the string,
    or the constant start of an f-string (``f"jpfs.cli.{name}"`` -> ``jpfs.cli``); "?" when it
    names nothing readable; None for any other call."""
    f = node.func
    dynamic = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
        isinstance(f, ast.Attribute) and f.attr == "import_module")
    if isinstance(f, ast.Attribute) and f.attr == "entry_points":
        return "?"  # plugins found at run time: an edge no reader can see
    if not dynamic or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".")
    return "?"


def _imports(name: str, path: Path, is_pkg: bool, typing: bool = True) -> set[str]:
    """Every module of ours that ``name`` imports (absolute names), at any depth in the file,
    including the targets of importlib calls ("?" for one whose target cannot be read);
    ``typing=False`` leaves out what only type checkers import (``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module
                                                                     else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call):
            target = _dynamic_target(node)
            if target == "?":
                out.add(target)
            elif target:
                out.add(target)
    return {m for m in out if m == "?" or m.split(".")[0] in PACKAGES}


LEVEL0_NAMES = {"errors", "types", "placement", "config", "uri"}


def _area(mod: str) -> str:
    parts = mod.split(".")
    if parts[0] != "jpfs":
        return parts[0]
    if len(parts) == 1:
        return "jpfs"  # the package facade (jpfs/__init__.py)
    if parts[1] in LEVEL0_NAMES or parts[1].startswith("__"):
        return "level0"
    return "jpfs." + parts[1]


# area -> areas it may import (besides itself and level 0): docs/design.md's layering, exactly
ALLOWED = {
    "jpfs": {"jpfs.client"},  # jpfs.connect() and jpfs.aconnect(), imported on use
    "jpfs.rpc": set(),
    "jpfs.coord": set(),  # etcd and the cluster map: level 0 only
    "jpfs.proto": {"jpfs.rpc"},
    "jpfs_daemon": {"jpfs.rpc", "jpfs.proto", "jpfs.coord"},
    "jpfs.client": {"jpfs.rpc", "jpfs.proto", "jpfs.coord"},
    "jpfs.fuse": {"jpfs.client"},  # never rpc or proto: the VFS in jpfs.client speaks for it
    # the dataset reads LeRobot metadata with jpfs.lerobot (an addition: docs/design-notes.md)
    "jpfs.torch": {"jpfs.client", "jpfs.lerobot"},
    "jpfs.lerobot": set(),
    "jpfs.localcluster": {"jpfs.coord"},
    "jpfs.cli": {"jpfs.client", "jpfs.localcluster", "jpfs.lerobot", "jpfs.fuse", "jpfs.coord"},
    # never jpfs.cli: cli runs bench
    "jpfs_bench": {"jpfs.client", "jpfs.localcluster", "jpfs.lerobot", "jpfs.torch",
                   "jpfs.fuse", "jpfs.rpc", "jpfs.proto", "jpfs.coord"},
}

EDGES = {
    # `jpfs bench` hangs bench's own entry under the jpfs command: the one edge up from cli
    # (`from jpfs_bench import entry`, which reads as both names)
    ("jpfs.cli.bench", "jpfs_bench"), ("jpfs.cli.bench", "jpfs_bench.entry"),
}
"""Single module-to-module edges allowed beyond ALLOWED, each with its reason."""


def _check(name: str, imported: set[str]) -> list[str]:
    area = _area(name)
    allowed = ALLOWED.get(area, set()) | {area, "level0"}
    bad = []
    for mod in imported:
        if mod == "?":
            bad.append(f"{name} imports a module named at run time (make the edge explicit)")
            continue
        target = _area(mod)
        if target == "jpfs" and mod == "jpfs":
            target = "level0"  # `import jpfs` / `from jpfs import config`: the package itself
        if target not in allowed and (name, mod) not in EDGES:
            bad.append(f"{name} imports {mod} ({area} may not import {target})")
    return bad


def test_the_checker_sees_importlib_and_entry_point_edges(tmp_path):
    code = ("import importlib\nimportlib.import_module('jpfs.cli.main')\n"
            "importlib.import_module(f'jpfs_bench.{x}')\n__import__(name)\n"
            "from importlib.metadata import entry_points\nentry_points(group='jpfs')\n")
    path = tmp_path / "probe.py"
    path.write_text(code)
    got = _imports("jpfs.rpc.probe", path, False)
    assert {"jpfs.cli.main", "jpfs_bench", "?"} <= got
    assert len(_check("jpfs.rpc.probe", got)) >= 3


def test_entry_points_lead_where_the_layering_allows():
    """setup.cfg's entry points are edges too: console scripts start cli or a daemon; the
    fsspec registry may reach only the client."""
    cfg = (ROOT / "setup.cfg").read_text()
    section = cfg[cfg.index("[options.entry_points]"):]
    targets = [line.split("=", 1)[1].strip().split(":")[0] for line in section.splitlines()
               if "=" in line and ":" in line]
    assert targets
    allowed = ("jpfs.cli.", "jpfs_daemon.", "jpfs.client.")
    assert all(t.startswith(allowed) for t in targets), targets


def test_import_direction():
    problems = []
    for name, path, is_pkg in _modules():
        problems += _check(name, _imports(name, path, is_pkg))
    assert not problems, "\n".join(sorted(problems))


def test_nothing_installs_as_top_level_daemon():
    cfg = (ROOT / "setup.cfg").read_text()
    assert "jpfs_daemon = daemon" in cfg
    assert not any(line.strip() == "daemon" for line in cfg.splitlines())


@pytest.mark.parametrize("module", ["jpfs", "jpfs.client", "jpfs.lerobot.dataset",
                                    "jpfs.cli.main"])
def test_import_works_without_torch(module):
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"import {module}\n"
        "if hasattr(sys.modules[%r], 'build_parser'):\n"
        "    sys.modules[%r].build_parser()\n"
        "assert 'torch' not in sys.modules\n" % (module, module)
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_no_module_imports_itself_back():
    """No import circle among our modules (cli -> bench -> runner, never back): a circle makes
    the module that runs first depend on import order."""
    modules = {name: (path, is_pkg) for name, path, is_pkg in _modules()}
    graph = {name: {m for m in _imports(name, path, is_pkg, typing=False)
                    if m in modules and m != name}
             for name, (path, is_pkg) in modules.items()}
    for name, (_, is_pkg) in modules.items():
        if is_pkg:  # a package importing its own submodules is not a circle back through it
            graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]))
            elif state[nxt] == 0:
                visit(nxt, path + [node])
        state[node] = 2

    for name in sorted(graph):
        if state[name] == 0:
            visit(name, [])
    assert not cycles, "\n".join(cycles)


CLIENT_LAYERS = {"wire": 0, "data": 1, "": 2, "vfs": 3, "tools": 3}
"""jpfs/client's folders, lowest first (docs/design.md): a module imports its own folder and
those below it; the VFS and the tools sit side by side on the path API, never on each other."""


def _client_folder(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[:2] != ["jpfs", "client"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in CLIENT_LAYERS else ""


def test_the_client_folders_import_downwards_only():
    problems = []
    for name, path, is_pkg in _modules():
        here = _client_folder(name)
        if here is None or name == "jpfs.client":
            continue
        for mod in _imports(name, path, is_pkg):
            there = _client_folder(mod)
            if there is None or mod == "jpfs.client" or there == here:
                continue
            if CLIENT_LAYERS[there] >= CLIENT_LAYERS[here]:
                problems.append(f"{name} imports {mod} (client/{here or '.'} sits below "
                                f"client/{there or '.'})")
    assert not problems, "\n".join(sorted(problems))


BENCH_MAY_IMPORT = {"jpfs.client", "jpfs.client.wire", "jpfs.client.tools",
                    "jpfs.client.fsspec_impl"}
"""What of the client a benchmark may import: the path API, the wire clients and the tools, each
by its package's public names (a benchmark measures what users run)."""


def test_bench_uses_the_clients_public_api_only():
    problems = []
    for name, path, _ in _modules():
        if not name.startswith("jpfs_bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jpfs.client"):
                if node.module not in BENCH_MAY_IMPORT:
                    problems.append(f"{name} imports {node.module}")
                problems += [f"{name} imports {node.module}.{a.name} (private)"
                             for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Import):
                problems += [f"{name} imports {a.name}" for a in node.names
                             if a.name.startswith("jpfs.client") and a.name not in BENCH_MAY_IMPORT]
    assert not problems, "\n".join(sorted(problems))
