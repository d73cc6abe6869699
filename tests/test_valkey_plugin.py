"""The third-party plugin package examples/plugins/kvstrata-valkey, pip-installed (scripts/test.sh):
found through its entry point, built on the plugin API only, and a working L3 shared by two
processes replaying a trace against a real server. Its conformance tests live in the package."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvstrata_valkey.testing import ValkeyServer

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "examples" / "plugins" / "kvstrata-valkey"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as running:
        yield running


def kvstrata(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env.update(COLUMNS="160", PYTHONPATH=str(REPO / "src"), KVSTRATA_CACHE_DIR=str(cwd / "cache"))
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def test_plugin_imports_nothing_of_kvstrata_but_the_plugin_api() -> None:
    for path in sorted((PLUGIN / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] == "kvstrata":
                    assert name == "kvstrata.plugins", f"{path.name} imports {name}"


def test_readme_abridged_backend_declares_what_the_plugin_does() -> None:
    """The top-level README's abridged ``ValkeyBackend`` is what authors copy: its ``requires``
    hint said ``pip install 'kvstrata-valkey'`` (a reinstall pip calls satisfied) after the
    plugin moved to the client's own requirement."""
    from kvstrata_valkey import ValkeyBackend

    readme = (REPO / "README.md").read_text()
    start = readme.index("# kvstrata_valkey/backend.py (abridged)")
    block = readme[start : readme.index("```", start)]
    line = next(row for row in block.splitlines() if row.strip().startswith("requires = "))
    declared = ast.literal_eval(line.split("=", 1)[1].split("#", 1)[0].strip())
    assert declared == ValkeyBackend.requires


def test_installed_plugin_is_listed_from_its_distribution(tmp_path: Path) -> None:
    proc = kvstrata("plugins", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in json.loads(proc.stdout) if r["name"] == "valkey")
    assert (row["distribution"], row["status"]) == ("kvstrata-valkey", "available")
    assert row["capabilities"]["shared_across_instances"] is True


def replay(server: ValkeyServer, out: Path, cwd: Path) -> dict[str, Any]:
    proc = kvstrata(
        "replay",
        "--limit",
        "30",
        "-c",
        str(REPO / "examples" / "configs" / "kv.yaml"),
        "--set",
        f"tiers.storage.l3={{type: valkey, url: '{server.url}'}}",
        "--json",
        str(out),
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"L3 l3 (valkey): {server.url}" in proc.stderr
    return json.loads(out.read_text())


def test_two_processes_share_the_valkey_l3(server: ValkeyServer, tmp_path: Path) -> None:
    first = replay(server, tmp_path / "first.json", tmp_path)
    assert first["bytes"]["host_to_storage"] > 0 and first["hit_rate"]["storage"] == 0.0
    second = replay(server, tmp_path / "second.json", tmp_path)
    assert second["hit_rate"]["storage"] > 0, "the second process is served from the server"
    assert second["bytes"]["storage_to_host"] > 0
    for result in (first, second):
        assert result["corrupt_pages_served"] == 0 and result["corrupt_pages_detected"] == 0
        assert result["failures"] == 0
