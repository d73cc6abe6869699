"""A storage backend that fails on purpose: FOR FAULT INJECTION ONLY, never for data.

It proves the contract "a failing backend fails that operation, never the process": tests (ours
and third parties') register it in-process and check that the cache keeps serving from L1/L2,
counts the failures, keeps its worker threads alive and leaks no host slot. It stores nothing.

    host.storage_backends.register(FaultyBackend)
    config: tiers.storage.broken: {type: faults, fail: raise}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from kvstrata.plugins.storage_backend import (
    ANY_POOL,
    BackendCapabilities,
    BackendConfig,
    PoolCapabilities,
    StorageBackend,
    StorageObject,
)


class FaultsConfig(BackendConfig):
    type: Literal["faults"] = "faults"
    fail: Literal["raise", "refuse"] = Field(
        default="raise", description="raise an exception, or answer 'not stored' / 'missing'"
    )
    operations: list[Literal["open", "exists", "put", "get"]] = Field(
        default=["exists", "put", "get"], description="calls that fail ('open' only when named)"
    )
    delay_s: float = Field(default=0.0, ge=0, description="sleep this long in every call (a slow store)")
    stall: list[Literal["exists", "put", "get"]] = Field(
        default=[], description="block these calls until the test calls `unstall()` (a stuck store)"
    )


class InjectedFault(RuntimeError):
    """The error every failing call raises (tests match on it)."""


class FaultyBackend(StorageBackend):
    """Fails the configured operations on every call; answers 'present' to existence otherwise
    (so a prefetch reaches ``get``)."""

    name = "faults"
    Config = FaultsConfig
    capabilities = BackendCapabilities(pools={ANY_POOL: PoolCapabilities()}, batch_exists=True)
    config: FaultsConfig

    def __init__(self, instance: str, config: BackendConfig) -> None:
        super().__init__(instance, config)
        self.calls = {"open": 0, "exists": 0, "put": 0, "get": 0}
        self._lock = threading.Lock()
        self._gate = threading.Event()  # stalled calls wait for it
        self.closed = threading.Event()

    def unstall(self) -> None:
        """Let every stalled call (and every later one) go on."""
        self._gate.set()

    def open(self) -> None:
        self._fails("open")  # with fail: raise, a plugin error the core must name by instance

    def close(self) -> None:
        self.closed.set()

    def _fails(self, operation: str) -> bool:
        with self._lock:
            self.calls[operation] += 1
        if operation in self.config.stall:
            self._gate.wait()
        if self.config.delay_s:
            time.sleep(self.config.delay_s)
        if operation not in self.config.operations:
            return False
        if self.config.fail == "raise":
            raise InjectedFault(f"injected {operation} failure ({self.instance})")
        return True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [not self._fails("exists")] * len(keys)

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        self._fails("put")
        return [False] * len(objects)

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        self._fails("get")
        return [-1] * len(objects)
