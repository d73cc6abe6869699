"""A real ``valkey-server`` (or ``redis-server``) for tests: a free loopback port, no persistence,
started and stopped by PID."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

LOOPBACK = "127.0.0.1"
SERVER_BINARIES = ("valkey-server", "redis-server")


def find_server() -> str:
    """Path of ``valkey-server`` or ``redis-server``; the error says how to install one."""
    for name in SERVER_BINARIES:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(
        "neither valkey-server nor redis-server is on PATH: apt-get install valkey-server "
        "(Debian 13+) or redis-server"
    )


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class ValkeyServer:
    """``with ValkeyServer(tmp_path) as server: server.url`` -> ``redis://127.0.0.1:PORT/0``."""

    def __init__(
        self,
        workdir: Path,
        maxmemory: str = "256mb",
        startup_timeout_s: float = 10.0,
        unixsocket: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        """``unixsocket``: also listen on ``workdir/valkey.sock`` (``server.unix_url``);
        ``extra_args``: more server options (``--cluster-enabled yes``)."""
        self.extra_args = tuple(extra_args)
        self.workdir = workdir
        self.unixsocket = unixsocket
        self.maxmemory = maxmemory
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / "valkey-server.log"

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.workdir / 'valkey.sock'}?db=0"

    def start(self) -> ValkeyServer:
        binary = find_server()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_loopback_port()
        args = [
            binary,
            "--bind", LOOPBACK,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            "--logfile", str(self.log),
        ]  # fmt: skip
        if self.unixsocket:
            args += ["--unixsocket", str(self.workdir / "valkey.sock"), "--unixsocketperm", "700"]
        args += self.extra_args
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{binary} exited with {self.process.returncode}: {self._log_tail()}")
            try:
                with socket.create_connection((LOOPBACK, self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{binary} did not answer on port {self.port}: {self._log_tail()}")

    def stop(self) -> None:
        """Terminate the server this object started (by its PID), then wait for it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
