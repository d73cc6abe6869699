"""The ``file`` backend's config model (its own module: the index and the I/O parts read it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvstrata.plugins.storage_backend import BackendConfig, StoragePath


class FileConfig(BackendConfig):
    """Config of the ``file`` backend (all field names are what users write)."""

    type: Literal["file"] = "file"
    path: StoragePath = Field(description="directory holding the objects (created if missing)")
    capacity_bytes: int | None = Field(default=None, ge=1, description="LRU-evict above this size")
    io_threads: int = Field(default=4, ge=1, le=64, description="parallel file operations per batch")
    fsync: bool = Field(default=False, description="fsync each object before it becomes visible")
    fanout_chars: int = Field(default=2, ge=0, le=4, description="hex digits of sub-directory fan-out")
    stale_temp_s: float = Field(
        default=600.0,
        gt=0,
        description=(
            "age after which another host's temp file is a dead writer's, removed at open (younger: "
            "counted); one of a gone process of this host is removed at once"
        ),
    )
    recycle_evicted: bool = Field(
        default=True,
        description=(
            "a put that evicts an object of its own size rewrites the evicted file (renamed to a "
            "temp file first) instead of unlinking it and creating one: its page-cache memory is "
            "reused, not freed and allocated again; only while every read is checksum-verified"
        ),
    )
    exists_recheck_s: float = Field(
        default=5.0,
        ge=0,
        description=(
            "exists answers from memory for objects this process saw on disk within this many seconds; "
            "older ones (another process may have removed them) and unknown keys are checked on disk "
            "(0: every key on disk)"
        ),
    )
