"""``mooncake``: Mooncake Store, in-process client or standalone (``mooncake_client``) mode."""

from __future__ import annotations

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

INSTALL = "pip install 'kvstrata[mooncake]'  (CPU-only machines: 'kvstrata[mooncake-cpu]')"


class MooncakeConfig(BackendConfig):
    type: Literal["mooncake"] = "mooncake"
    master: str = Field(default="127.0.0.1:50051", description="mooncake_master host:port")
    metadata_server: str = Field(default="P2PHANDSHAKE", description="metadata URL or P2PHANDSHAKE")
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_names: str = ""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = Field(default=1 << 30, ge=0, description="DRAM this process contributes")
    local_buffer_bytes: int = Field(default=64 << 20, ge=0)
    standalone: bool = Field(default=False, description="talk to a local mooncake_client (setup_dummy)")
    client: str = Field(default="127.0.0.1:50052", description="mooncake_client RPC host:port")


class MooncakeBackend(StorageBackend):
    name = "mooncake"
    Config = MooncakeConfig
    requires = {"mooncake.store": INSTALL}
    capabilities = BackendCapabilities(
        pools={ANY_POOL: PoolCapabilities(zero_copy=True, split_heads=True)},
        batch_exists=True,
        multi_buffer_objects=True,
        atomic_visibility=True,
        shared_across_instances=True,
        self_evicting=True,
    )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        raise NotImplementedError("mooncake backend I/O is not implemented yet (issue #4)")

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        raise NotImplementedError("mooncake backend I/O is not implemented yet (issue #4)")

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        raise NotImplementedError("mooncake backend I/O is not implemented yet (issue #4)")
