"""Page hashes and physical storage keys.

Page hash chain
    ``h[i] = BLAKE2b-128(h[i-1] || tokens of page i as little-endian uint32)`` with
    ``h[-1]`` = the parent's last page hash, or at the root the *namespace root*
    ``BLAKE2b-128(person=b"kvstrata-ns-v1", model name NUL cache salt)``. BLAKE2b (stdlib hashlib, a
    fixed algorithm, never Python's ``hash``) was chosen over xxh3_128 because a chain key is a
    trust boundary: with a non-cryptographic hash a user could craft a prefix colliding with
    another user's prefix of the same tenant and be served their state; BLAKE2b makes that
    infeasible. Its cost (~1 GB/s) is negligible next to moving the pages it names (a 64-token
    page is 256 hashed bytes vs tens of KiB of state). Seeding the chain with the namespace means
    two models or tenants can never share an entry even if their keys were built identically.

Physical keys
    Built only by :class:`KeySchema` (one per pool and process) as
    ``{namespace}.{pool_type}-{pool}-{layout}.{shard}.{page_hash}.{suffix}``, ``layout`` a short
    digest of the pool's layout fingerprints (dtype, shapes, layers, page size: everything that
    shapes an object's bytes), so deployments of one model with another dtype or shape never
    share a key -- with the fingerprint in the header alone they read each other's objects as
    foreign and removed them, each destroying the other's cache; every component uses only
    ``[A-Za-z0-9_-]`` and components are ``.``-separated, so keys are safe as file names and as
    Mooncake keys. ``shard`` is ``tp{r}of{n}-pp{r}of{n}-cp{r}of{n}`` for sharded pools and
    ``rep-pp{r}of{n}-cp{r}of{n}`` for TP-replicated ones: a replicated pool is identical across
    TP ranks only (pipeline stages hold different layers; context-parallel ranks are kept apart
    because layer-split CP made first-writer-wins corruption in SGLang), and only TP rank 0
    writes it (:func:`is_writer`). DP rank is not in keys: DP replicas with the same shard layout
    share entries.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from kvstrata.core.config import ParallelConfig
from kvstrata.core.integrity import FORMAT_VERSION, layout_fingerprint, stored_objects
from kvstrata.plugins.pool_type import PoolSpec, Replication

#: Bytes of one page hash (hex strings are twice as long).
PAGE_HASH_BYTES = 16
#: Version tag of the key layout, which moves with the object format: bump FORMAT_VERSION when
#: the schema, the chain or the format changes (old entries miss). Under one key a reader takes
#: another format's object as foreign and removes it, so two releases sharing an L3 would
#: delete each other's objects; under keys of their own they coexist.
KEY_VERSION = f"k{FORMAT_VERSION}"

_NAMESPACE_PERSON = b"kvstrata-ns-v1"
_PAGE_PERSON = b"kvstrata-pg-v1"
_LAYOUT_PERSON = b"kvstrata-lt-v1"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_MAX_TOKEN = 2**32 - 1


def namespace_root(model_name: str, cache_salt: str = "") -> str:
    """Root of every page-hash chain of one model and tenant (hex)."""
    data = model_name.encode() + b"\0" + cache_salt.encode()
    return hashlib.blake2b(data, digest_size=PAGE_HASH_BYTES, person=_NAMESPACE_PERSON).hexdigest()


def _token_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Tokens as one contiguous little-endian uint32 array (vectorised, validated)."""
    is_tensor = isinstance(tokens, torch.Tensor)
    array = tokens.detach().to("cpu").numpy() if is_tensor else np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > _MAX_TOKEN):
        raise ValueError("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(array, dtype="<u4")


def hash_pages(
    tokens: Sequence[int] | np.ndarray | torch.Tensor, page_size: int, parent_hash: str
) -> list[str]:
    """Chained hashes (hex) of every *full* page of ``tokens``; a trailing partial page is ignored.

    ``parent_hash`` is the last page hash of the parent node, or :func:`namespace_root` at the
    root. The loop is per page (a chain is sequential), never per token.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    data = _token_bytes(tokens)
    pages = data.size // page_size
    raw = data[: pages * page_size].tobytes()
    step = page_size * 4
    previous = bytes.fromhex(parent_hash)
    if len(previous) != PAGE_HASH_BYTES:
        raise ValueError(f"parent_hash must be {PAGE_HASH_BYTES * 2} hex digits, got {parent_hash!r}")
    result: list[str] = []
    for start in range(0, pages * step, step):
        digest = hashlib.blake2b(previous, digest_size=PAGE_HASH_BYTES, person=_PAGE_PERSON)
        digest.update(raw[start : start + step])
        previous = digest.digest()
        result.append(previous.hex())
    return result


def safe_component(text: str) -> str:
    """A key component with only ``[A-Za-z0-9_-]`` (other runs become ``-``)."""
    cleaned = _UNSAFE.sub("-", text).strip("-")
    return cleaned or "x"


def distinct_component(text: str) -> str:
    """:func:`safe_component`, with a digest of ``text`` where cleaning changed it: two pools named
    ``c.4`` and ``c-4`` shared one key and served each other's bytes."""
    cleaned = safe_component(text)
    digest = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    return cleaned if cleaned == text else f"{cleaned}-{digest}"


def namespace_tag(model_name: str, cache_salt: str = "") -> str:
    """Readable, collision-proof namespace component: sanitised model name + root digest."""
    return f"{KEY_VERSION}-{safe_component(model_name)[:48]}-{namespace_root(model_name, cache_salt)[:12]}"


def layout_tag(spec: PoolSpec) -> str:
    """10 hex digits over the layout fingerprint of every object a unit of ``spec`` stores."""
    digest = hashlib.blake2b(digest_size=5, person=_LAYOUT_PERSON)
    for suffix, _ in stored_objects(spec):
        digest.update(layout_fingerprint(spec, suffix))
    return digest.hexdigest()


def is_writer(spec: PoolSpec, parallel: ParallelConfig) -> bool:
    """Whether this rank writes the pool: every rank for sharded pools, TP rank 0 for replicated."""
    return spec.replication is Replication.SHARDED or parallel.tp_rank == 0


def shard_tag(spec: PoolSpec, parallel: ParallelConfig) -> str:
    """The shard component of a key (see module docstring)."""
    rest = f"pp{parallel.pp_rank}of{parallel.pp_size}-cp{parallel.cp_rank}of{parallel.cp_size}"
    if spec.replication is Replication.REPLICATED:
        return f"rep-{rest}"
    return f"tp{parallel.tp_rank}of{parallel.tp_size}-{rest}"


class KeySchema(BaseModel):
    """The one declared key layout of a pool in this process; every backend key comes from here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    pool: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="pool type + instance name")
    shard: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    writer: bool = Field(description="whether this rank writes the pool (one writer if replicated)")

    @classmethod
    def for_pool(
        cls, spec: PoolSpec, *, model_name: str, cache_salt: str = "", parallel: ParallelConfig
    ) -> KeySchema:
        return cls(
            namespace=namespace_tag(model_name, cache_salt),
            pool=f"{safe_component(spec.pool_type)}-{distinct_component(spec.name)}-{layout_tag(spec)}",
            shard=shard_tag(spec, parallel),
            writer=is_writer(spec, parallel),
        )

    @property
    def prefix(self) -> str:
        return f"{self.namespace}.{self.pool}.{self.shard}."

    def key(self, page_hash: str, suffix: str) -> str:
        """Physical key of one object of one unit."""
        return f"{self.prefix}{page_hash}.{suffix}"

    def keys(self, page_hashes: Sequence[str], suffix: str) -> list[str]:
        prefix, tail = self.prefix, f".{suffix}"
        return [prefix + page_hash + tail for page_hash in page_hashes]
