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


def test_core_modules_fit_on_a_screen_or_two() -> None:
    """Every part of the core stays readable: no module over 500 lines, no class over 300."""
    paths = sorted((PACKAGE / "core").glob("*.py"))
    assert PACKAGE / "core" / "controller.py" in paths and PACKAGE / "core" / "tree.py" in paths
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


# --- no import circles ---------------------------------------------------------------------------

#: circles another branch of issue 28 removes (the storage metrics move out of the engine); empty
#: this set when it lands
_KNOWN_CIRCLES = {frozenset({"kvstrata.core.backend_calls", "kvstrata.core.storage_engine"})}


def _import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` (laid out under ``root``) it imports anywhere: at the
    top, under ``TYPE_CHECKING`` or inside a function (a deferred import is still an arrow)."""
    files = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                named.add(base)
                named.update(f"{base}.{alias.name}" for alias in node.names)
        graph[module] = {name for name in named if name in files and name != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                found.add(frozenset(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_circles_counts_type_checking_deferred_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "sub" / "c.py").write_text("from .. import d\n")
    (pkg / "d.py").write_text("import pkg.sub.c\n")
    (pkg / "e.py").write_text("import pkg.a\n")  # into a circle, not part of it
    assert _circles(_import_graph(pkg, "pkg")) == {
        frozenset({"pkg.a", "pkg.b"}),
        frozenset({"pkg.sub.c", "pkg.d"}),
    }


def test_core_has_no_import_circle() -> None:
    """Every arrow between core modules points one way, ``TYPE_CHECKING`` imports included: a
    reader can take the core bottom-up, and nothing needs a deferred import to load."""
    graph = _import_graph(PACKAGE / "core", "kvstrata.core")
    assert {"kvstrata.core.tokens", "kvstrata.core.lease"} <= graph["kvstrata.core.controller"]
    circles = _circles(graph) - _KNOWN_CIRCLES
    assert not circles, sorted(sorted(circle) for circle in circles)
