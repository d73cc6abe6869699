"""The README's library example is a test: it must run as printed and do what it says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller_support import REPO

MARKER = "<!-- library-example -->"


def test_the_library_example_runs_as_printed(tmp_path) -> None:
    readme = (REPO / "README.md").read_text()
    assert MARKER in readme, "the README lost its library example marker"
    block = re.search(r"```python\n(.*?)```", readme[readme.index(MARKER) :], re.S)
    assert block is not None
    script = tmp_path / "example.py"
    script.write_text(block.group(1))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.split(" ", 1)[0] == "64", done.stdout  # the checkpoint at page 4 of the shared 70 tokens
    assert "'device': 4" in last and last.endswith("{}")


# --- every shell command of the README (issue 27): run as printed, through the console script ---

#: Commands of the README that this test does not run, each with the reason. A new command that is
#: neither run nor listed here fails :func:`test_every_readme_command_is_run_or_explained`.
NOT_RUN = {
    "bash scripts/test.sh": "it is the test command itself (CI runs it)",
    "python -m sglang.launch_server": "needs SGLang on a GPU and a model download",
    # the line's --kv-transfer-config is parsed by vLLM's own KVTransferConfig and the
    # connector's config loader in tests/test_adapter_vllm.py
    "vllm serve": "needs vLLM's server on a GPU and a model download",
}
#: The install half of the first command: CI installs the checkout, test_packaging a wheel.
INSTALL = "pip install 'torch==2.13.0' -e '.[mooncake-cpu,plot]' && "


def readme_commands() -> list[str]:
    """Every command line of the README's ``bash`` blocks (continuations joined)."""
    readme = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                commands.append(command.strip())
    return commands


def runnable(command: str) -> str | None:
    """The part of a README command this test runs, or None for those in NOT_RUN."""
    if any(command.startswith(prefix) for prefix in NOT_RUN):
        return None
    return command.removeprefix(INSTALL)


def test_every_readme_command_is_run_or_explained() -> None:
    commands = readme_commands()
    assert len(commands) >= 10, commands
    for command in commands:
        part = runnable(command)
        assert part is None or part.startswith("kvstrata "), (
            f"README command neither run nor in NOT_RUN: {command}"
        )


@pytest.mark.parametrize("command", [part for c in readme_commands() if (part := runnable(c))])
def test_readme_command_runs_as_printed(command: str, tmp_path) -> None:
    """In a fresh directory holding the checkout's ``examples/``, with the ``kvstrata`` console
    script, output piped (as CI sees it); each must exit 0."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    script = shutil.which("kvstrata")
    path = os.pathsep.join([*([str(Path(script).parent)] if script else []), os.environ["PATH"]])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env.update(
        PATH=path,
        PYTHONPATH=str(REPO / "src"),
        KVSTRATA_CACHE_DIR=str(tmp_path / "user-cache"),
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        MPLBACKEND="Agg",
    )
    if script is None:  # no console script on PATH: the same entry point as a module
        command = command.replace("kvstrata ", f"{sys.executable} -m kvstrata ", 1)
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"


def test_the_readme_names_only_traces_a_clone_has() -> None:
    """Issue 27: the README pointed at data/traces/, which a clone lacks. It names the bundled
    sample (which exists) and says where the full traces come from."""
    readme = (REPO / "README.md").read_text()
    assert "data/traces/" not in readme.replace("shared/data/traces", "")
    assert "src/kvstrata/replay/data/sample_trace.jsonl" in readme
    assert (REPO / "src/kvstrata/replay/data/sample_trace.jsonl").is_file()
    assert "KVSTRATA_TRACE_DIR" in readme and "FAST25-release/traces/" in readme


@pytest.mark.parametrize(
    "command", ["replay", "simulate", "doctor", "plugins", "config validate", "config show", "config schema"]
)
def test_the_readme_names_every_option_of_every_command(command: str) -> None:
    """Each option ``--help`` lists is in the README (audit s45: ``simulate --block-size``,
    ``--capacities`` and ``--max-request-tokens`` were documented nowhere)."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata", *command.split(), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    options = set(re.findall(r"^│ +(--[a-z][a-z-]*)", done.stdout, re.M)) - {"--help"}
    readme = (REPO / "README.md").read_text()
    missing = sorted(o for o in options if not re.search(rf"{o}\b", readme))
    assert options or command == "config schema", done.stdout  # (it takes none)
    assert not missing, f"kvstrata {command}: options the README does not name: {missing}"
