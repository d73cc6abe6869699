"""``memory``: an L3 in this process's memory, with optional latency and bandwidth.

For tests, ``simulate``-style experiments and adapter authors who want an L3 without a disk or a
server. Objects live in a dict of immutable ``bytes`` for as long as the backend instance is open:
nothing is shared with another process or outlives this one (``persistent=False``,
``shared_across_instances=False``), so a second run starts empty.

``latency_s`` is slept once per call (``exists``, ``put``, ``get``, ``remove``), ``bandwidth_bytes_per_s``
adds ``bytes / bandwidth`` to every ``put`` and ``get``: an L3 of a chosen speed, e.g. to see how
prefetch and load-back behave over a slow network store. ``capacity_bytes`` keeps the
least-recently used objects and evicts the rest (the backend makes room by itself).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
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
    object_views,
)

#: ``get``'s answer for a key this backend does not hold.
MISS = -1


class MemoryConfig(BackendConfig):
    type: Literal["memory"] = "memory"
    capacity_bytes: int | None = Field(
        default=None, ge=0, description="keep at most this many bytes (LRU); None: no cap"
    )
    latency_s: float = Field(default=0.0, ge=0, description="slept once per call (a network round trip)")
    bandwidth_bytes_per_s: float | None = Field(
        default=None, gt=0, description="put/get also sleep bytes / this (None: memory speed)"
    )


class MemoryBackend(StorageBackend):
    """Objects as ``bytes`` in an LRU-ordered dict; every call is thread-safe (one lock)."""

    name = "memory"
    Config = MemoryConfig
    capabilities = BackendCapabilities(
        pools={ANY_POOL: PoolCapabilities()},
        batch_exists=True,
        multi_buffer_objects=True,
        atomic_visibility=True,  # an object is inserted only once all its bytes are copied
        persistent=False,
        shared_across_instances=False,
        self_evicting=True,
        removable=True,
    )
    config: MemoryConfig

    def __init__(self, instance: str, config: BackendConfig) -> None:
        super().__init__(instance, config)
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def where(self) -> str | None:
        return "in this process's memory: objects go when it exits"

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def _wait(self, nbytes: int = 0) -> None:
        delay = self.config.latency_s
        if self.config.bandwidth_bytes_per_s and nbytes:
            delay += nbytes / self.config.bandwidth_bytes_per_s
        if delay:
            time.sleep(delay)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._wait()
        with self._lock:
            found = [key in self._objects for key in keys]
            for key, present in zip(keys, found, strict=True):
                if present:
                    self._objects.move_to_end(key)
        return found

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        self._wait(sum(obj.nbytes for obj in objects))
        cap = self.config.capacity_bytes
        stored: list[bool] = []
        for obj in objects:
            if cap is not None and obj.nbytes > cap:
                stored.append(False)
                continue
            data = b"".join(bytes(view) for view in object_views(obj))
            with self._lock:
                if obj.key in self._objects:  # equal keys carry equal bytes: skip the rewrite
                    self._objects.move_to_end(obj.key)
                else:
                    self._objects[obj.key] = data
                    self._bytes += len(data)
                    self._evict(cap)
            stored.append(True)
        return stored

    def _evict(self, cap: int | None) -> None:
        """Drop least-recently used objects until the cap holds (lock held)."""
        while cap is not None and self._bytes > cap and self._objects:
            _key, data = self._objects.popitem(last=False)
            self._bytes -= len(data)

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        with self._lock:
            found = [self._objects.get(obj.key) for obj in objects]
            for obj, data in zip(objects, found, strict=True):
                if data is not None:
                    self._objects.move_to_end(obj.key)
        self._wait(sum(len(data) for data in found if data is not None))
        results: list[int] = []
        for obj, data in zip(objects, found, strict=True):
            if data is None:
                results.append(MISS)
                continue
            offset = 0
            for view in object_views(obj):
                chunk = data[offset : offset + len(view)]
                view[: len(chunk)] = chunk
                offset += len(chunk)
                if offset >= len(data):
                    break
            results.append(offset)
        return results

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Drop objects; an absent key counts as removed (True), as the plugin contract says."""
        self._wait()
        with self._lock:
            for key in keys:
                data = self._objects.pop(key, None)
                if data is not None:
                    self._bytes -= len(data)
        return [True] * len(keys)

    def close(self) -> None:
        with self._lock:
            self._objects.clear()
            self._bytes = 0

    # --- test hook (conformance kit) ------------------------------------------------------------

    def corrupt_for_test(self, key: str, mode: Literal["flip", "truncate"], offset: int = -1) -> bool:
        """Damage a stored object on purpose: flip one byte or cut it in half."""
        with self._lock:
            data = self._objects.get(key)
            if data is None:
                return False
            if mode == "truncate":
                damaged = data[: len(data) // 2]
            else:
                position = offset % len(data)
                damaged = data[:position] + bytes([data[position] ^ 0xFF]) + data[position + 1 :]
            self._objects[key] = damaged
            self._bytes += len(damaged) - len(data)
        return True
