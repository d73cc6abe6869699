"""``file``: the embedded default backend, one file per object in a local directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
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


class FileConfig(BackendConfig):
    type: Literal["file"] = "file"
    path: Path = Field(description="directory holding the objects (created if missing)")
    capacity_bytes: int | None = Field(default=None, ge=1, description="LRU-evict above this size")


class FileBackend(StorageBackend):
    name = "file"
    Config = FileConfig
    capabilities = BackendCapabilities(
        pools={ANY_POOL: PoolCapabilities(zero_copy=True)},
        batch_exists=True,
        multi_buffer_objects=True,
        atomic_visibility=True,
        persistent=True,
        shared_across_instances=True,
        self_evicting=True,
    )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        raise NotImplementedError("file backend I/O is not implemented yet (issue #4)")

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        raise NotImplementedError("file backend I/O is not implemented yet (issue #4)")

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        raise NotImplementedError("file backend I/O is not implemented yet (issue #4)")
