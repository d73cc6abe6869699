"""Shared helpers of the fault matrix: the real ``kvstrata`` entry point in fresh processes, small
traces and stacks written to disk, and what every case checks about the command's answer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvstrata.plugins.storage_backend import OBJECT_MAGIC

REPO = Path(__file__).resolve().parents[2]
#: Per-process deadline of a CLI run in this matrix: a run that has not ended by then hangs.
CLI_DEADLINE_S = 120


def cli_env(cwd: Path, extra: dict[str, str] | None = None, site: Path | None = None) -> dict[str, str]:
    """The environment of a fresh CLI process: no KVSTRATA_* of the caller, this checkout's src."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    paths = [str(site)] if site else []
    return {
        **base,
        "COLUMNS": "200",
        "KVSTRATA_CACHE_DIR": str(cwd / "user-cache"),
        "PYTHONPATH": os.pathsep.join([*paths, str(REPO / "src")]),
        **(extra or {}),
    }


def run_cli(
    *args: str | Path,
    cwd: Path,
    env: dict[str, str] | None = None,
    site: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
    timeout: float = CLI_DEADLINE_S,
) -> subprocess.CompletedProcess[str]:
    """``python -m kvstrata ARGS`` in a fresh process (pipes, not a terminal); a run past
    ``timeout`` fails the test as a hang."""
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(cwd, env, site),
        cwd=cwd,
        timeout=timeout,
        check=False,
        preexec_fn=preexec_fn,
    )


def popen_cli(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The CLI started in the background, stderr line-buffered for the caller to follow."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvstrata", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=cli_env(cwd, env),
        cwd=cwd,
    )


def write_trace(path: Path, conversations: int, turns: int, blocks_per_turn: int = 2) -> Path:
    """Conversations whose turns extend the previous turn's prefix (512-token blocks), turns
    interleaved in arrival order, so later turns hit what earlier ones stored."""
    lines = []
    for turn in range(turns):
        for conv in range(conversations):
            ids = [conv * 100_000 + i for i in range((turn + 1) * blocks_per_turn)]
            request = {
                "timestamp": len(lines),
                "input_length": len(ids) * 512,
                "output_length": 1,
                "hash_ids": ids,
            }
            lines.append(json.dumps(request))
    path.write_text("\n".join(lines) + "\n")
    return path


def write_stack(
    path: Path, *, name: str = "faults", storage: dict[str, Any] | None = None, **policy: Any
) -> Path:
    """KV only, 64 bytes per token, 512-token pages; device 64 pages, host 128 pages."""
    data: dict[str, Any] = {
        "model": {
            "name": name,
            "page_size": 512,
            "pools": {"kv": {"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 8}},
        },
        "tiers": {"device": {"capacity_tokens": 64 * 512}, "host": {"capacity_tokens": 128 * 512}},
    }
    if storage is not None:
        data["tiers"]["storage"] = storage
    if policy:
        data["policy"] = policy
    path.write_text(yaml.safe_dump(data))
    return path


def file_l3(path: Path, **fields: Any) -> dict[str, Any]:
    return {"l3": {"type": "file", "path": str(path), **fields}}


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def assert_clean_refusal(proc: subprocess.CompletedProcess[str], *needles: str, code: int = 2) -> str:
    """The answer to bad input: exit ``code``, exactly one ``error:`` line naming the problem (each
    of ``needles``), no traceback, and no run started. Returns the error line."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "replaying" not in proc.stderr, "checked before any work starts"
    return lines[0]


def replay_json(
    tmp: Path, stack: Path, trace: Path, *extra: str, label: str = "r", **kwargs: Any
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """``kvstrata replay TRACE -c STACK --json OUT``: the process and the JSON (None if absent)."""
    out = tmp / f"{label}.json"
    proc = run_cli("replay", trace, "-c", stack, "--json", out, *extra, cwd=tmp, **kwargs)
    return proc, json.loads(out.read_text()) if out.is_file() else None


def object_files(l3: Path) -> list[Path]:
    """The store's object files (its own magic; temp files and anything else left out)."""
    return sorted(
        p for p in l3.rglob("*") if p.is_file() and p.read_bytes()[: len(OBJECT_MAGIC)] == OBJECT_MAGIC
    )


def stderr_lines(proc: subprocess.CompletedProcess[str], needle: str) -> Sequence[str]:
    return [line for line in proc.stderr.splitlines() if needle in line]


def run_main(argv: Sequence[str | Path], capsys: Any, monkeypatch: Any) -> tuple[int, str, str]:
    """The console-script function ``kvstrata.cli.main`` in this process (exit code, stdout,
    stderr): the entry point itself, without paying a fresh interpreter and torch per case."""
    from kvstrata.cli import main

    for name in [n for n in os.environ if n.startswith("KVSTRATA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys, "argv", ["kvstrata", *map(str, argv)])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class FollowedRun:
    """A CLI run in the background whose stderr is read as it comes (progress every 0.2 s), so a
    test can act at a point of the run -- stop a master after N requests -- by PID."""

    def __init__(self, *args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.proc = popen_cli(*args, cwd=cwd, env={"KVSTRATA_PROGRESS_S": "0.2", **(env or {})})
        self.lines: list[str] = []
        self.out: list[str] = []
        assert self.proc.stderr is not None and self.proc.stdout is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stderr, self.lines), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def replayed(self) -> int:
        """Requests replayed so far, from the newest progress line (0 before the first)."""
        for line in reversed(self.lines):
            found = _PROGRESS.match(line)
            if found:
                return int(found.group(1).replace(",", ""))
        return 0

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what}: not within {timeout_s} s; stderr so far:\n" + "\n".join(self.lines)
                )
            if self.proc.poll() is not None and not predicate():
                raise AssertionError(f"{what}: the run ended first; stderr:\n" + "\n".join(self.lines))
            time.sleep(0.05)

    def finish(self, timeout_s: float = CLI_DEADLINE_S) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); a run past ``timeout_s`` is killed and fails the test."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"hung past {timeout_s} s:\n" + "\n".join(self.lines)) from None
        for reader in self._readers:
            reader.join(timeout=10)
        return self.proc.returncode, "\n".join(self.out), "\n".join(self.lines)


_PROGRESS = re.compile(r"^replayed ([\d,]+)/")
