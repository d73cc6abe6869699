"""Architecture rules a reader relies on, checked from the source so they cannot drift.

Plugins (storage backends, pool types) use only the plugin API: a third-party package must be
able to do everything a built-in one does (that the core never names a built-in plugin is
checked in test_core_names_no_plugin.py).
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
        for folder in ("storage_backends", "pool_types")
        for path in (PACKAGE / folder).glob("*.py")
        for module in _imports(path)
        if module == "kvstrata.core" or module.startswith("kvstrata.core.")
    }
    assert not offenders, sorted(offenders)
