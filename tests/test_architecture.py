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
