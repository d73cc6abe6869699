"""``hf3fs``: DeepSeek 3FS through its USRBIO API (stub until a 3FS mount is available)."""

from __future__ import annotations

import importlib.util
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


class HF3FSConfig(BackendConfig):
    type: Literal["hf3fs"] = "hf3fs"
    path: Path = Field(description="directory on a 3FS mount")
    mock: bool = Field(default=False, description="use an ordinary file instead of USRBIO (tests)")


class HF3FSBackend(StorageBackend):
    name = "hf3fs"
    Config = HF3FSConfig
    capabilities = BackendCapabilities(
        pools={ANY_POOL: PoolCapabilities(zero_copy=False)},
        batch_exists=True,
        persistent=True,
        shared_across_instances=True,
    )

    @classmethod
    def unavailable_reason(cls, config: BackendConfig | None = None) -> str | None:
        if isinstance(config, HF3FSConfig) and config.mock:
            return None
        if importlib.util.find_spec("hf3fs_fuse") is None:
            return (
                "module hf3fs_fuse.io is not installed: it ships with a 3FS deployment (built in "
                "3FS's dev container), not on PyPI; set mock: true to use the file-backed mock"
            )
        return None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        raise NotImplementedError("hf3fs backend I/O is not implemented yet (issue #4)")

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        raise NotImplementedError("hf3fs backend I/O is not implemented yet (issue #4)")

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        raise NotImplementedError("hf3fs backend I/O is not implemented yet (issue #4)")
