"""Ctrl-C in ``kvstrata replay`` (issue 27, item 1), the way a user meets it: the installed console
script on a real pseudo-terminal, the interrupt typed as the ^C character (the terminal's line
discipline turns it into SIGINT for the whole foreground process group, the native-log child
included). One line says what was kept, the exit status is 130, no traceback, and the L3 it
leaves serves the next run; a second Ctrl-C exits at once."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "configs" / "demo.yaml"

#: Fault injection (a labelled test double): the memory backend made slow to write, so L3
#: writes are still in flight when the second Ctrl-C arrives.
SLOW_L3 = """
from typing import Literal
from kvstrata.storage_backends.memory import MemoryBackend, MemoryConfig

class SlowConfig(MemoryConfig):
    type: Literal["slowmem"] = "slowmem"
    latency_s: float = 3.0

class SlowMemory(MemoryBackend):
    name = "slowmem"
    Config = SlowConfig
"""

#: Fault injection (a labelled test double): the file backend made slow to write, so a replay
#: with ``--fresh`` (its L3 in a temporary directory) has writes in flight at the second Ctrl-C.
SLOW_FILE = """
import time
from typing import Literal
from kvstrata.storage_backends._file_config import FileConfig
from kvstrata.storage_backends.file import FileBackend

class SlowFileConfig(FileConfig):
    type: Literal["slowfile"] = "slowfile"

class SlowFile(FileBackend):
    name = "slowfile"
    Config = SlowFileConfig

    def put(self, objects):
        time.sleep(3.0)
        return super().put(objects)
"""


def console_script() -> list[str]:
    script = shutil.which("kvstrata")
    return [script] if script else [sys.executable, "-m", "kvstrata"]


def environment(tmp_path: Path, site: Path | None = None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    paths = [str(site)] if site else []
    return {
        **base,
        "PYTHONPATH": os.pathsep.join([*paths, str(REPO / "src")]),
        "KVSTRATA_CACHE_DIR": str(tmp_path / "user-cache"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "COLUMNS": "120",
        "TERM": "xterm",
    }


class Terminal:
    """A command on a pseudo-terminal that is its controlling terminal (as in a shell)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the pty is its controlling terminal and stdin/stdout/stderr
            try:
                os.chdir(cwd)
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.output = pid, fd, b""

    def read_until(self, pattern: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while re.search(pattern.encode(), self.output) is None:
            if time.monotonic() > deadline or not self._read(deadline - time.monotonic()):
                return False
        return True

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: the other side closed
            return False
        self.output += chunk
        return bool(chunk)

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.2)
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                while self._read(0.1):
                    pass
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        raise AssertionError(f"still running after {timeout} s: {self.text}")

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")


def test_ctrl_c_prints_what_was_kept_exits_130_and_the_l3_serves_the_next_run(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    argv = [*console_script(), "replay", "-c", str(DEMO), "--set", f"tiers.storage.l3.path={l3}"]
    term = Terminal(argv, environment(tmp_path), tmp_path)
    assert term.read_until(r"replayed", 240), term.text
    term.read_until(r"replayed.*\b[1-9]\d*/300", 60)  # a few requests in, when the machine allows
    term.ctrl_c()
    code = term.wait(120)
    text = term.text
    assert code == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    kept = re.search(r"interrupted after (\d+) of 300 requests; L3 writes flushed: \d+", text)
    assert kept is not None, text
    done = int(kept.group(1))
    assert 0 <= done < 300
    # The L3 it left is consistent: a second run over the same requests reads it back verified.
    report = tmp_path / "second.json"
    second = subprocess.run(
        [
            *console_script(),
            "replay",
            "-c",
            str(DEMO),
            "--set",
            f"tiers.storage.l3.path={l3}",
            "--limit",
            str(max(done, 1)),
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        env=environment(tmp_path),
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert second.returncode == 0, second.stderr
    result = json.loads(report.read_text())
    assert result["corrupt_pages_detected"] == 0 and result["corrupt_pages_served"] == 0
    if done >= 2:  # what the first run wrote (write-through) is found again
        assert result["hit_rate"]["storage"] > 0, result


def test_a_second_ctrl_c_exits_at_once_naming_the_abandoned_writes(make_distribution, tmp_path: Path) -> None:
    site = make_distribution(
        "kvstrata-slowmem",
        "0.1",
        {"kvstrata.storage_backends": {"slowmem": "kvstrata_slowmem:SlowMemory"}},
        {"kvstrata_slowmem": SLOW_L3},
    )
    argv = [*console_script(), "replay", "-c", str(DEMO), "--set", "tiers.storage.l3={type: slowmem}"]
    term = Terminal(argv, environment(tmp_path, site), tmp_path)
    assert term.read_until(r"replayed", 240), term.text
    term.ctrl_c()
    assert term.read_until(r"interrupt: finishing", 60), term.text
    term.ctrl_c()
    code = term.wait(30)
    text = term.text
    assert code == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    abandoned = re.search(r"interrupted again: exiting at once; L3 write batches abandoned: (\d+)", text)
    assert abandoned is not None, text


def test_a_second_ctrl_c_removes_the_temporary_l3_directory(make_distribution, tmp_path: Path) -> None:
    # the exit at once skipped the `finally` that removes it: "(empty, temporary, removed
    # afterwards)" was left in $TMPDIR, hundreds of MB after a longer run
    site = make_distribution(
        "kvstrata-slowfile",
        "0.1",
        {"kvstrata.storage_backends": {"slowfile": "kvstrata_slowfile:SlowFile"}},
        {"kvstrata_slowfile": SLOW_FILE},
    )
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**environment(tmp_path, site), "TMPDIR": str(scratch)}
    l3 = "tiers.storage.l3={type: slowfile, path: " + str(tmp_path / "unused") + "}"
    argv = [*console_script(), "replay", "-c", str(DEMO), "--set", l3, "--fresh"]
    term = Terminal(argv, env, tmp_path)
    assert term.read_until(r"replayed", 240), term.text
    assert list(scratch.glob("kvstrata-replay-l3-*")), "the run's L3 is in a temporary directory"
    term.ctrl_c()
    assert term.read_until(r"interrupt: finishing", 60), term.text
    term.ctrl_c()
    code = term.wait(60)
    text = term.text
    assert code == 130 and "interrupted again: exiting at once" in text, text
    assert "temporary L3 directory removed" in text, text
    assert list(scratch.glob("kvstrata-replay-l3-*")) == []


def test_ctrl_c_in_another_command_is_one_line_and_130(tmp_path: Path) -> None:
    """``simulate`` of a long trace: nothing to flush, so it stops at once, without a traceback
    or click's "Aborted!" and exit 1."""
    trace = tmp_path / "long.jsonl"
    with trace.open("w") as out:
        for i in range(60_000):
            ids = list(range(i % 97, i % 97 + 20))
            out.write(
                json.dumps({"timestamp": i, "input_length": 10240, "output_length": 1, "hash_ids": ids})
                + "\n"
            )
    term = Terminal([*console_script(), "simulate", str(trace)], environment(tmp_path), tmp_path)
    assert term.read_until(r"simulated", 240), term.text
    term.ctrl_c()
    code = term.wait(60)
    assert code == 130, term.text
    assert "Traceback" not in term.text and "Aborted" not in term.text, term.text
    assert "interrupted" in term.text


def test_sigterm_removes_the_temporary_l3_directory(tmp_path: Path) -> None:
    """``timeout`` and CI cancel a run with SIGTERM: Python's default action ended the process
    without its ``finally``, so the run's temporary L3 directory stayed in $TMPDIR (hundreds of
    MB after a longer run). It now goes, with one line and exit 143 (128 + SIGTERM)."""
    import signal

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**environment(tmp_path), "TMPDIR": str(scratch)}
    term = Terminal([*console_script(), "replay"], env, tmp_path)  # the packaged stack, temporary L3
    assert term.read_until(r"replayed", 240), term.text
    assert list(scratch.glob("kvstrata-replay-l3-*")), "the run's L3 is in a temporary directory"
    os.kill(term.pid, signal.SIGTERM)
    code = term.wait(60)
    text = term.text
    assert code == 143, text
    assert "Traceback" not in text and "terminated" in text, text
    assert list(scratch.glob("kvstrata-replay-l3-*")) == [], text
