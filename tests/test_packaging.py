"""What a user installs: every module-level third-party import is a declared dependency, and a
non-editable install (a built wheel in a fresh virtual environment) replays with no argument."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "kvstrata"


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def module_level_imports(path: Path) -> set[str]:
    """Top-level names imported when the module is imported (not inside functions)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_module_level_third_party_import_is_a_declared_dependency() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    optional = {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    stdlib = set(sys.stdlib_module_names)
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for path in sorted(SRC.rglob("*.py")):
        if "testing" in path.relative_to(SRC).parts:
            continue  # the pytest plugin runs under pytest only
        allowed = set(declared)
        if path.parent.name == "adapters":
            # an adapter imports the engine it adapts (kvstrata/adapters/<engine>.py imports <engine>),
            # installed by the user or through the adapter's extra
            allowed |= {path.stem.lstrip("_").split("_")[0]} | optional
        for name in module_level_imports(path) - stdlib - {"kvstrata"}:
            dists = {d.lower().replace("_", "-") for d in providers.get(name, [name])}
            if not dists & allowed:
                undeclared[f"{path.relative_to(REPO)}: {name}"] = sorted(dists)
    assert not undeclared, f"imported at module level but not in [project] dependencies: {undeclared}"
    assert "numpy" in declared  # replay/report.py and replay/simulate.py import it


def test_packaged_default_config_is_the_example() -> None:
    packaged = SRC / "replay" / "data" / "hybrid-mamba.yaml"
    assert packaged.read_text() == (REPO / "examples" / "configs" / "hybrid-mamba.yaml").read_text()


def test_wheel_in_a_fresh_venv_replays_with_no_argument(tmp_path: Path) -> None:
    """``pip install .`` (not editable), then ``kvstrata replay`` from an unrelated directory."""
    wheels = tmp_path / "wheels"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("KVSTRATA_")}
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    [wheel] = wheels.glob("kvstrata-*.whl")
    venv = tmp_path / "venv"
    # the base interpreter's site-packages hold torch and the other dependencies
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run(
        [base, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, install.stderr
    site = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    # the venv's kvstrata, not the source tree; the dependencies come from the parent environment
    # (an editable install of the checkout there puts its src on the path after the venv's own)
    parent_site = [p for p in sys.path if p.endswith("site-packages")]
    run_env = {**env, "PYTHONPATH": os.pathsep.join([site, *parent_site]), "COLUMNS": "120"}
    where = subprocess.run(
        [str(python), "-c", "import kvstrata.cli; print(kvstrata.cli.__file__)"],
        capture_output=True,
        text=True,
        env=run_env,
        cwd=workdir,
        check=True,
    )
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    out = workdir / "r.json"
    proc = subprocess.run(
        [str(venv / "bin" / "kvstrata"), "replay", "--limit", "20", "--json", str(out)],
        capture_output=True,
        text=True,
        env=run_env,
        cwd=workdir,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["requests"] == 20 and result["failures"] == 0 and result["hit_rate"]["total"] > 0


def test_the_hf_adapter_without_transformers_names_its_extra() -> None:
    """Without transformers the adapter's import said only "No module named 'transformers'"; a
    plain ``pip install transformers`` brings a version the adapter is not pinned to."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import kvstrata.adapters.hf\n"
        "except ModuleNotFoundError as exc:\n    print(exc.name, '|', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == (
        "transformers | kvstrata.adapters.hf needs transformers: run `pip install 'kvstrata[hf]'`"
    )
