"""The ``mooncake`` backend's config model (its own module: every part of the backend reads it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kvstrata.plugins.storage_backend import BackendConfig

#: Mooncake refuses smaller segments ("Total size must be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20


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
    connect_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="deadline of the probes before open, close and after an outage (the endpoint must "
        "accept TCP and answer), and Mooncake's RPC connect deadline",
    )
    rpc_timeout_s: float | None = Field(
        default=5.0,
        gt=0,
        description="deadline of each Mooncake RPC, bounding every batch (exported as MC_RPC_TIMEOUT_MS; "
        "None keeps Mooncake's environment / 30 s default)",
    )
    staging_bytes: int = Field(
        default=4 << 20,
        ge=4096,
        description="registered area that unregistered regions (integrity headers, a copy plan's pages) "
        "are copied through; grows (doubling) for an object larger than it",
    )
    host_memory_limit_bytes: int | None = Field(
        default=None,
        ge=1,
        description="standalone: most host-pool bytes allocate_host_memory may hand out (None = no cap)",
    )

    @field_validator("segment_bytes")
    @classmethod
    def _segment_minimum(cls, value: int) -> int:
        if 0 < value < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"segment_bytes={value}: Mooncake needs 0 (contribute no memory) or at least "
                f"{MIN_SEGMENT_BYTES} bytes (16 MiB)"
            )
        return value
