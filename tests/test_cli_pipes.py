"""A reader that closes the pipe early (``kvstrata plugins --json | head -1``): quiet, and the
exit code the command's own, however fast the reader left (``kvstrata/cli/pipes.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "configs" / "demo.yaml"


def run_with_stdout_closed(*args: str, cwd: Path, read_first: bool = False) -> tuple[int, str]:
    """Run ``python -m kvstrata ARGS`` with stdout a pipe whose read end is closed before the
    command writes anything (or, ``read_first``, after its first line); its exit code and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env.update({"COLUMNS": "200", "PYTHONPATH": str(REPO / "src"), "KVSTRATA_CACHE_DIR": str(cwd / "c")})
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstrata", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    assert proc.stdout is not None and proc.stderr is not None
    if read_first:
        proc.stdout.readline()
    proc.stdout.close()  # the reader is gone (``head`` exited) before the command writes
    try:
        stderr = proc.stderr.read().decode()
        return proc.wait(timeout=240), stderr
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("read_first", [False, True], ids=["closed-at-once", "after-one-line"])
def test_a_closed_stdout_exits_as_the_command_would_and_quietly(tmp_path: Path, read_first: bool) -> None:
    """``plugins --json | head -1`` exited 1 (click's EPIPE handling) or 0 (the output fit in
    the pipe before ``head`` left) depending on timing; now always 0 and nothing on stderr."""
    code, stderr = run_with_stdout_closed("plugins", "--json", cwd=tmp_path, read_first=read_first)
    assert code == 0, stderr
    assert stderr == "", stderr


def test_a_closed_stdout_keeps_the_verdict_and_its_lines(tmp_path: Path) -> None:
    """A command that finds a problem still says so on stderr and exits with its own code: the
    broken pipe at its first table ended it with exit 1 before the ``problem:`` lines."""
    bad = f"tiers.storage.l3={{type: hf3fs, path: {tmp_path / 'l3'}}}"
    code, stderr = run_with_stdout_closed("doctor", str(DEMO), "--set", bad, cwd=tmp_path)
    assert code == 1, stderr
    assert "problem: backend 'l3' (hf3fs)" in stderr and "Traceback" not in stderr
    assert "BrokenPipe" not in stderr and "Exception ignored" not in stderr
