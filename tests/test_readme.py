"""The README's library example is a test: it must run as printed and do what it says."""

from __future__ import annotations

import re
import subprocess
import sys

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
