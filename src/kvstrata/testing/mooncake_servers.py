"""Start and stop REAL Mooncake processes on free loopback ports, for tests and benchmarks.

Mooncake's master and standalone client are separate binaries; tests that fake them would prove
nothing about return codes, leases or eviction. These helpers start the real binaries, wait
(bounded) until their RPC port accepts connections, capture their logs to files and stop them by
PID (terminate, wait, kill). Use them as context managers, or through the session-scoped pytest
fixtures ``mooncake_master`` and ``mooncake_standalone_client`` (registered by kvstrata's pytest
plugin) so a test session pays the start-up once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvstrata.storage_backends.mooncake import MooncakeConfig, tcp_probe

MOONCAKE_INSTALL = "pip install 'kvstrata[mooncake-cpu]'"  # (the servers: either extra brings them)
LOOPBACK = "127.0.0.1"


class MooncakeBinaryMissing(RuntimeError):
    """The mooncake_master / mooncake_client binaries are not installed."""


def find_mooncake_binary(name: str) -> str:
    """Locate ``name`` on PATH or beside the running interpreter (a venv's ``bin/``)."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise MooncakeBinaryMissing(
            f"{name} not found on PATH or next to {sys.executable}; install it with `{MOONCAKE_INSTALL}`"
        )
    return found


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    return free_loopback_ports(1)[0]


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now. Each is held until all are
    picked: a port closed before the next pick may be picked again (one master start in a few
    thousand got two equal ports and failed to listen)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((LOOPBACK, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(text[-lines:])


@dataclass
class ManagedProcess:
    """One child process we started: its argv, log file and the port that says it is ready."""

    name: str
    argv: list[str]
    ready_port: int
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, ready_timeout_s: float = 20.0) -> None:
        """Start the process and wait until ``ready_port`` accepts; on failure show the log tail.
        Whatever ends the wait other than readiness (a timeout, Ctrl-C) stops the process: a
        fixture whose setup raised gets no teardown, and the process would outlive the session."""
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
            )
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, ready_timeout_s: float) -> None:
        assert self.popen is not None
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.popen.returncode} before listening on "
                    f"{LOOPBACK}:{self.ready_port}; command: {' '.join(self.argv)}\n"
                    f"log tail ({self.log_path}):\n{_log_tail(self.log_path)}"
                )
            if tcp_probe(f"{LOOPBACK}:{self.ready_port}", 0.2) is None:
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"{self.name} did not listen on {LOOPBACK}:{self.ready_port} within {ready_timeout_s:.0f} s; "
            f"log tail ({self.log_path}):\n{_log_tail(self.log_path)}"
        )

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate this PID, wait, then kill it if it ignored SIGTERM."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=grace_s)

    def log_tail(self, lines: int = 30) -> str:
        return _log_tail(self.log_path, lines)


class MooncakeMaster:
    """A real ``mooncake_master`` on free loopback ports with an HTTP metadata server.

    ``lease_ttl_ms`` defaults low (500 ms) so reads in one test don't pin objects against the
    eviction or removal another test relies on; ``client_ttl_s`` low so a dead client's segment
    leaves the pool quickly.
    """

    def __init__(
        self,
        log_dir: Path | None = None,
        lease_ttl_ms: int = 500,
        client_ttl_s: int = 3,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.rpc_port, self.http_port, self.metrics_port = free_loopback_ports(3)
        self._tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="kvstrata-mc-")
        self.log_dir = Path(log_dir if log_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        argv = [
            find_mooncake_binary("mooncake_master"),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={LOOPBACK}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={LOOPBACK}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={lease_ttl_ms}",
            f"--client_ttl={client_ttl_s}",
            *extra_args,
        ]
        self.process = ManagedProcess("mooncake_master", argv, self.rpc_port, self.log_dir / "master.log")

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service (``MooncakeConfig.master``)."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of the master's HTTP metadata server (``MooncakeConfig.metadata_server``)."""
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    def backend_config(self, **fields: Any) -> MooncakeConfig:
        """An in-process (``setup``) ``MooncakeConfig`` against this master, plus ``fields``."""
        return MooncakeConfig(master=self.address, metadata_server=self.metadata_url, **fields)

    def start(self) -> MooncakeMaster:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class MooncakeStandaloneClient:
    """A real ``mooncake_client`` (the process that owns the segment in standalone mode)."""

    def __init__(
        self,
        master: MooncakeMaster,
        segment_bytes: int = 256 << 20,
        log_dir: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = free_loopback_port()
        self.master = master
        argv = [
            find_mooncake_binary("mooncake_client"),
            f"--host={LOOPBACK}",
            f"--port={self.port}",
            f"--global_segment_size={segment_bytes}",
            f"--master_server_address={master.address}",
            f"--metadata_server={master.metadata_url}",
            "--protocol=tcp",
            *extra_args,
        ]
        directory = Path(log_dir) if log_dir is not None else master.log_dir
        log_path = directory / f"client-{self.port}.log"
        self.process = ManagedProcess("mooncake_client", argv, self.port, log_path)

    @property
    def address(self) -> str:
        """``host:port`` for ``MooncakeConfig.client`` (``setup_dummy``)."""
        return f"{LOOPBACK}:{self.port}"

    def backend_config(self, **fields: Any) -> MooncakeConfig:
        """A standalone (``setup_dummy``) ``MooncakeConfig`` talking to this client, plus ``fields``."""
        return MooncakeConfig(standalone=True, client=self.address, **fields)

    def start(self) -> MooncakeStandaloneClient:
        self.process.start(ready_timeout_s=30.0)
        return self

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> MooncakeStandaloneClient:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
