"""Architecture rules a reader relies on, checked from the source so they cannot drift.

Plugins (storage backends, pool types, eviction policies) use only the plugin API: a third-party
package must be able to do everything a built-in one does (that the core never names a built-in
plugin is checked in test_core_names_no_plugin.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvstrata

PACKAGE = Path(kvstrata.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every module an (absolute) import statement in ``path`` names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_plugins_import_nothing_from_the_core() -> None:
    offenders = {
        f"{path.relative_to(PACKAGE)} imports {module}"
        for folder in ("storage_backends", "pool_types", "eviction_policies")
        for path in (PACKAGE / folder).glob("*.py")
        for module in _imports(path)
        if module == "kvstrata.core" or module.startswith("kvstrata.core.")
    }
    assert not offenders, sorted(offenders)


MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300


def _oversized(paths: list[Path]) -> list[str]:
    """Modules over ``MAX_MODULE_LINES`` lines and classes over ``MAX_CLASS_LINES`` in ``paths``."""
    found = []
    for path in paths:
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"{path.name}:{node.lineno} class {node.name}: {size} lines")
    return found


def test_oversized_finds_a_long_module_and_a_long_class(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    long_class = tmp_path / "long_class.py"
    long_class.write_text(f"class Big:\n{body}\n")
    long_module = tmp_path / "long_module.py"
    long_module.write_text("\n".join(f"y{i} = {i}" for i in range(MAX_MODULE_LINES + 1)) + "\n")
    small = tmp_path / "small.py"
    small.write_text("class Small:\n    pass\n")
    assert _oversized([long_class, long_module, small]) == [
        f"long_class.py:1 class Big: {MAX_CLASS_LINES + 1} lines",
        f"long_module.py: {MAX_MODULE_LINES + 1} lines",
    ]


def test_every_module_fits_on_a_screen_or_two() -> None:
    """Every part of kvstrata stays readable: no module over 500 lines, no class over 300."""
    paths = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "core" / "controller.py" in paths and PACKAGE / "cli" / "_app.py" in paths
    assert PACKAGE / "storage_backends" / "file.py" in paths
    assert not _oversized(paths), _oversized(paths)


def test_the_architecture_doc_names_every_core_module() -> None:
    doc = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    missing = [p.name for p in sorted((PACKAGE / "core").glob("*.py")) if p.name != "__init__.py"]
    missing = [name for name in missing if f"`{name}`" not in doc]
    assert not missing, f"docs/architecture.md does not say what these core modules own: {missing}"


# --- a Lease's state is written by lease.py alone ----------------------------------------------------

#: methods that change the container they are called on
_MUTATORS = {"append", "extend", "insert", "update", "pop", "popitem", "clear", "setdefault", "remove", "add"}


def _lease_fields() -> set[str]:
    """Every field of ``Lease``, read from its class body (so a new field is covered at once)."""
    module = ast.parse((PACKAGE / "core" / "lease.py").read_text())
    (lease,) = [node for node in module.body if isinstance(node, ast.ClassDef) and node.name == "Lease"]
    return {
        node.target.id
        for node in lease.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def _names_a_lease(node: ast.expr) -> bool:
    return "lease" in ast.unparse(node).lower()


def _lease_writes(paths: list[Path], fields: set[str]) -> list[str]:
    """Writes to a Lease's state outside lease.py: assigning, deleting or mutating (``.append``,
    ``[k] = ``, ``setattr``) one of its private ``fields`` on anything but ``self``, or any of its
    ``fields`` on an expression that names a lease."""

    def written(target: ast.expr) -> ast.Attribute | None:
        while isinstance(target, ast.Subscript):  # lease._prefix["kv"] = ... changes the lease too
            target = target.value
        if not isinstance(target, ast.Attribute) or target.attr not in fields:
            return None
        if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
            return None
        return target if target.attr.startswith("_") or _names_a_lease(target.value) else None

    found: set[tuple[str, int, str]] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = list(node.targets)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in _MUTATORS:
                    targets = [node.func.value]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                obj, name = node.args[0], node.args[1]
                named = isinstance(name, ast.Constant) and name.value in fields
                dynamic = not isinstance(name, ast.Constant) and _names_a_lease(obj)
                if (named and name.value.startswith("_")) or dynamic or (named and _names_a_lease(obj)):
                    found.add((path.name, node.lineno, ast.unparse(node)))
                continue
            flat: list[ast.expr] = []
            for target in targets:
                flat += list(target.elts) if isinstance(target, ast.Tuple | ast.List) else [target]
            for target in flat:
                hit = written(target)
                if hit is not None:
                    found.add((path.name, node.lineno, ast.unparse(hit)))
    return [f"{name}:{line} {text}" for name, line, text in sorted(found)]


def test_lease_writes_finds_every_kind_of_write(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(lease, parts, other):\n"
        "    lease._node = 1\n"
        "    a, parts.lease._pin = 1, 2\n"
        "    lease._storage_pages += 1\n"
        "    lease._allocated['kv'] = 3\n"
        "    lease._prefix.update({})\n"
        "    other._first.append(4)\n"
        "    del lease._hashes\n"
        "    setattr(lease, '_host_lock', None)\n"
        "    for attr in ('_device_lock',):\n"
        "        setattr(lease, attr, None)\n"
        "    lease.closed = True\n"
    )
    clean = tmp_path / "clean.py"
    clean.write_text(
        "class C:\n"
        "    def f(self, lease, other):\n"
        "        self._node = lease._node\n"  # a class of its own with a field of the same name
        "        other._unrelated = lease.pages\n"
        "        other.closed = True\n"  # not a lease
        "        lease.skipped.get('x')\n"
        "        setattr(other, 'name', 1)\n"
    )
    assert _lease_writes([planted, clean], _lease_fields()) == [
        "planted.py:2 lease._node",
        "planted.py:3 parts.lease._pin",
        "planted.py:4 lease._storage_pages",
        "planted.py:5 lease._allocated",
        "planted.py:6 lease._prefix",
        "planted.py:7 other._first",
        "planted.py:8 lease._hashes",
        "planted.py:9 setattr(lease, '_host_lock', None)",
        "planted.py:11 setattr(lease, attr, None)",
        "planted.py:12 lease.closed",
    ]


def test_only_lease_py_writes_a_lease() -> None:
    """The controller and its parts move a lease through its transition methods (lock, settle,
    allocate, insert, close); none of them writes its fields."""
    fields = _lease_fields()
    assert {"_node", "_prefetch", "_device_lock", "_allocated", "closed"} <= fields
    paths = [path for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "core" / "lease.py"]
    assert not _lease_writes(paths, fields), _lease_writes(paths, fields)


# --- the import graph: every import counts, TYPE_CHECKING and function-local ones included ------


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package at ``root`` (a package's name is its folder)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its source.

    ``from a.b import c`` is an edge to ``a.b.c`` when ``c`` is a submodule, else to ``a.b``;
    relative imports are resolved; an import of a module outside the package is not an edge.
    Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too, but those are not edges:
    every module would sit in a circle with its package's ``__init__`` otherwise.
    """
    modules = _modules(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.add(submodule if submodule in modules else base)
        graph[name] = {t for t in map(known, targets) if t is not None and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles: strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(frozenset(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / relative.split("/")[0]


def test_circles_are_found_through_type_checking_relative_and_submodule_imports(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "from pkg.sub.low import helper\n",
            # a -> b as ``from pkg import b`` (a submodule, not the package's __init__)
            "pkg/a.py": "from pkg import b\n",
            # b -> a only while type checking, and relative
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
            # c -> sub.low (an attribute of a submodule); sub.low -> c from inside a function
            "pkg/c.py": "from pkg.sub.low import helper\n",
            "pkg/sub/low.py": "def helper():\n    from ..c import x\n",
            "pkg/d.py": "import os\nfrom pkg.sub import low\n",  # no circle: nothing imports d
        },
    )
    graph = _import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub.low"] == {"pkg.c"} and graph["pkg.d"] == {"pkg.sub.low"}
    assert sorted(map(sorted, _circles(graph))) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.low"]]


def test_no_import_circles() -> None:
    circles = sorted(sorted(circle) for circle in _circles(_import_graph(PACKAGE)))
    assert not circles, f"import circles (TYPE_CHECKING and function-local imports count): {circles}"


# --- layers: imports point down ----------------------------------------------------------------

#: The layers of kvstrata, lowest first. A part imports only parts of lower layers (and itself):
#: plugins know nothing of the core, the core nothing of the public facade, and nothing below
#: the front ends and adapters knows them. ``kvstrata.hookspecs`` re-exports the plugin API.
LAYERS: list[set[str]] = [
    {"plugins"},
    {"pool_types", "storage_backends", "eviction_policies", "hookspecs"},
    {"core"},
    {"api", "engine_kit"},
    {""},  # kvstrata/__init__.py: the public API (lazy re-exports)
    {"adapters", "replay", "testing", "prometheus", "progress"},
    {"cli"},
    {"__main__"},
]


def _part(module: str) -> str:
    """The top-level part of kvstrata a module belongs to ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _arrows_up(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Imports from a part to a part of the same or a higher layer (or to a part no layer names)."""
    level = {part: number for number, members in enumerate(layers) for part in members}
    found = []
    for module, targets in sorted(graph.items()):
        source = _part(module)
        for target in sorted(targets):
            into = _part(target)
            if into == source:
                continue
            if source not in level or into not in level or level[into] >= level[source]:
                found.append(f"{module} -> {target}")
    return found


def test_arrows_up_are_found(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/plugins/__init__.py": "",
            "pkg/plugins/host.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.core import x\n",
            "pkg/core/__init__.py": "",
            "pkg/core/x.py": "from pkg.plugins import host\nfrom .y import z\n",
            "pkg/core/y.py": "from pkg import extra\n",  # a part no layer names
            "pkg/extra.py": "",
            "pkg/storage_backends/file.py": "from pkg.pool_types import kv\n",  # a peer, same layer
            "pkg/pool_types/kv.py": "from pkg.plugins import host\n",
        },
    )
    layers = [{"plugins"}, {"pool_types", "storage_backends"}, {"core"}]
    assert _arrows_up(_import_graph(package), layers) == [
        "pkg.core.y -> pkg.extra",
        "pkg.plugins.host -> pkg.core.x",
        "pkg.storage_backends.file -> pkg.pool_types.kv",
    ]


def test_imports_point_down_the_layers() -> None:
    graph = _import_graph(PACKAGE)
    assert {_part(module) for module in graph} <= set().union(*LAYERS), "a part no layer names"
    assert not _arrows_up(graph, LAYERS), _arrows_up(graph, LAYERS)


def _reach_ins(graph: dict[str, set[str]], part: str, forbidden: str) -> list[str]:
    """Imports from modules of ``part`` into modules of ``forbidden`` (top-level parts)."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _part(module) == part
        for target in targets
        if _part(target) == forbidden
    )


def test_reach_ins_are_found(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/core/__init__.py": "",
            "pkg/core/keys.py": "",
            "pkg/kit.py": "from pkg.core.keys import h\n",  # the public seam: allowed
            "pkg/adapters/__init__.py": "",
            "pkg/adapters/good.py": "from pkg.kit import h\nimport pkg\n",
            "pkg/adapters/bad.py": "def f():\n    from ..core import keys\n",
        },
    )
    assert _reach_ins(_import_graph(package), "adapters", "core") == ["pkg.adapters.bad -> pkg.core.keys"]


def test_adapters_use_the_public_api_not_the_core() -> None:
    """Adapters import ``kvstrata``, ``kvstrata.engine_kit`` and ``kvstrata.plugins``, never
    ``kvstrata.core`` (DESIGN: adapters sit above the core like the CLI)."""
    graph = _import_graph(PACKAGE)
    assert "kvstrata.adapters._shared" in graph
    assert not _reach_ins(graph, "adapters", "core"), _reach_ins(graph, "adapters", "core")
