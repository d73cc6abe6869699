"""``mooncake``: Mooncake Store, in-process client or standalone (``mooncake_client``) mode.

Two ways to join a Mooncake cluster:

* **in-process** (``standalone: false``): ``setup()`` makes this process a real client that
  contributes ``segment_bytes`` of DRAM to the pool and moves data itself. Host pools are ordinary
  memory, registered with ``register_host_memory``.
* **standalone** (``standalone: true``): ``setup_dummy()`` forwards every call to a local
  ``mooncake_client`` process that owns the segment. That process can only touch memory it maps, so
  every buffer handed to Mooncake must come from ``alloc_from_mem_pool`` (a memfd it receives):
  host pools are allocated by this backend (``allocate_host_memory``; the instance declares
  ``host_allocator=True``).

Regions outside registered memory (the core's small integrity headers, which live in ordinary
memory) are copied through a **registered staging area** owned by the backend whenever Mooncake
needs registered memory (standalone mode, or a protocol other than TCP). With in-process TCP they
are passed through directly, since the TCP/memcpy transports read any address. The staging area is
``staging_bytes`` large and guarded by a lock; a batch whose unregistered bytes exceed it is
transferred in several calls.

Return codes (per key): ``0`` / byte count = success; ``-200`` = no space (not stored, not fatal:
the master evicts asynchronously); ``-704`` = object not found (a miss); ``-9xx`` = RPC failure
(master or client unreachable: a dead one answers after ~4 s; after such a batch the backend
TCP-probes the endpoint before each call and fails in milliseconds while it is down). A batch in
which every key failed with an RPC code raises :class:`StorageError`: an outage is a failed call
(which the core's circuit breaker counts), never a cold cache. Counts of every non-success code
are kept in :attr:`MooncakeBackend.code_counts`.

Deadlines. An endpoint that accepts TCP but never answers (a SIGSTOPped master, a port that is
not a Mooncake service) would block each RPC for Mooncake's default 30 s, and ``setup`` /
``close`` -- which hold the GIL, so no thread can wait for them with a timeout -- for tens of
seconds to minutes. Hence:

* ``rpc_timeout_s`` / ``connect_timeout_s`` are exported as ``MC_RPC_TIMEOUT_MS`` /
  ``MC_RPC_CONNECT_TIMEOUT_MS`` before ``setup`` (process-wide: Mooncake reads them from the
  environment), so every data call to the master returns by itself within a few RPC deadlines. A
  data call is never abandoned: a late one could still write into host memory the cache reused.
* ``open`` and ``close`` first check that the endpoint *answers* (:func:`answer_probe`: a live
  Mooncake service answers or closes a connection that sends it garbage at once) within
  ``connect_timeout_s``; one that does not is refused at open, and at close its store is left
  unclosed on purpose (closing it would block the caller; see :meth:`MooncakeBackend.close`).
* After a batch in which every key failed with an RPC code, each call answer-probes first and fails
  within ``connect_timeout_s`` while the endpoint does not answer; the core's circuit breaker then
  stops calling the backend altogether.

Not bounded: in standalone mode the dummy client's RPC to ``mooncake_client`` ignores
``MC_RPC_TIMEOUT_MS`` (observed: 30 s for the first call after the client was SIGSTOPped); later
calls fail within ``connect_timeout_s`` as above.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import importlib
import importlib.metadata
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, field_validator

from kvstrata.plugins.errors import MissingDependencyError, StorageError
from kvstrata.plugins.storage_backend import (
    ANY_POOL,
    BackendCapabilities,
    BackendConfig,
    BufferRegion,
    PoolCapabilities,
    StorageBackend,
    StorageObject,
    leading_regions,
)

INSTALL = "pip install 'kvstrata[mooncake]'  (CPU-only machines: 'kvstrata[mooncake-cpu]')"
STORE_MODULE = "mooncake.store"
#: The distributions of the extras ``mooncake`` (CUDA) and ``mooncake-cpu``: both ship ``mooncake``.
WHEELS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


def _installed(*distributions: str) -> list[str]:
    """Those of ``distributions`` that are installed."""
    found = []
    for name in distributions:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


#: Mooncake ``ErrorCode`` values the backend reacts to (see mooncake-store ``types.h``).
NO_AVAILABLE_HANDLE = -200  # segment full: the object was not stored
INVALID_PARAMS = -600
REPLICA_NOT_READY = -703  # another writer's put of this key is still in flight
OBJECT_NOT_FOUND = -704
#: Waits before re-reading objects that answered -703 (a put of the same key by another thread or
#: process is finishing; Mooncake reports success to the second writer at once). ~40 ms in all.
NOT_READY_BACKOFF_S = (0.001, 0.002, 0.004, 0.008, 0.025)
TRANSFER_FAIL = -800  # e.g. a multi-buffer read whose regions do not match the object size
RPC_FAIL = -900  # -9xx (<= -900): master / client RPC failed
#: Mooncake refuses smaller segments ("Total size must be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20
#: Returned by :meth:`MooncakeBackend.get` for an object the backend could not even try to read.
STAGING_TOO_SMALL = -600

_log = logging.getLogger(__name__)

#: (position of the object in one Mooncake call, scratch ptr, original ptr, nbytes)
_Staged = tuple[int, int, int, int]


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
        description="registered area that unregistered regions (integrity headers) are copied through",
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


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise StorageError(f"mooncake address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def tcp_probe(address: str, timeout_s: float) -> str | None:
    """``None`` when ``address`` accepts a TCP connection within ``timeout_s``, else why not."""
    try:
        host, port = _split_address(address)
    except StorageError as exc:
        return str(exc)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{address} did not accept a TCP connection within {timeout_s:g} s ({exc})"


class Endpoint(StrEnum):
    ANSWERS = "answers"
    SILENT = "silent"  # accepts TCP, reads nothing: a stopped process, or a socket nobody serves
    UNREACHABLE = "unreachable"  # refused, or no TCP connection within the deadline


def check_endpoint(address: str, timeout_s: float) -> tuple[Endpoint, str]:
    """Whether a process at ``address`` reads what it is sent within ``timeout_s``, and why not.

    Mooncake's RPC services answer a malformed request (64 zero bytes) at once, by closing the
    connection or with an error frame; a stopped process, or a socket nobody serves, lets it sit
    in the kernel's buffers. Accepting TCP alone proves neither: the kernel accepts for them.
    """
    try:
        host, port = _split_address(address)
    except StorageError as exc:
        return Endpoint.UNREACHABLE, str(exc)
    deadline = time.monotonic() + timeout_s
    try:
        connection = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        return (
            Endpoint.UNREACHABLE,
            f"{address} did not accept a TCP connection within {timeout_s:g} s ({exc})",
        )
    with connection:
        try:
            connection.sendall(bytes(64))
            connection.settimeout(max(0.001, deadline - time.monotonic()))
            connection.recv(64)  # data or an orderly close: somebody read the request
        except TimeoutError:
            return Endpoint.SILENT, (
                f"{address} accepts connections but did not answer within {timeout_s:g} s "
                "(a stopped process, or not a Mooncake service?)"
            )
        except OSError:
            pass  # reset or broken pipe: the peer read the request and refused it
    return Endpoint.ANSWERS, f"{address} answers"


def answer_probe(address: str, timeout_s: float) -> str | None:
    """``None`` when the endpoint answers within ``timeout_s`` (:func:`check_endpoint`), else why not."""
    state, reason = check_endpoint(address, timeout_s)
    return None if state is Endpoint.ANSWERS else reason


class _Ranges:
    """Sorted, merged address intervals: answers "is [ptr, ptr+n) fully covered?" by bisection."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def covers(self, ptr: int, nbytes: int) -> bool:
        index = bisect.bisect_right(self.starts, ptr) - 1
        return index >= 0 and ptr + nbytes <= self.ends[index]

    def gaps(self, ptr: int, nbytes: int) -> list[tuple[int, int]]:
        """Sub-ranges of [ptr, ptr+n) not yet covered, as (start, length)."""
        out: list[tuple[int, int]] = []
        cursor, end = ptr, ptr + nbytes
        index = max(bisect.bisect_right(self.starts, ptr) - 1, 0)
        while cursor < end and index < len(self.starts):
            start, stop = self.starts[index], self.ends[index]
            if stop <= cursor:
                index += 1
                continue
            if start >= end:
                break
            if start > cursor:
                out.append((cursor, start - cursor))
            cursor = max(cursor, stop)
            index += 1
        if cursor < end:
            out.append((cursor, end - cursor))
        return out

    def add(self, ptr: int, nbytes: int) -> None:
        start, end = ptr, ptr + nbytes
        index = bisect.bisect_left(self.ends, start)
        while index < len(self.starts) and self.starts[index] <= end:
            start = min(start, self.starts[index])
            end = max(end, self.ends[index])
            del self.starts[index], self.ends[index]
        self.starts.insert(index, start)
        self.ends.insert(index, end)


class MooncakeBackend(StorageBackend):
    name = "mooncake"
    Config = MooncakeConfig
    requires = {STORE_MODULE: INSTALL}
    capabilities = BackendCapabilities(
        pools={ANY_POOL: PoolCapabilities(zero_copy=True, split_heads=True)},
        batch_exists=True,
        multi_buffer_objects=True,
        atomic_visibility=True,
        shared_across_instances=True,
        self_evicting=True,
        removable=True,
    )

    config: MooncakeConfig

    def __init__(self, instance: str, config: BackendConfig) -> None:
        super().__init__(instance, config)
        self._store: Any = None
        self._registered = _Ranges()
        self._allocated_bytes = 0
        self._staging: BufferRegion | None = None
        self._staging_keepalive: Any = None  # owner of in-process staging memory
        self._staging_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._rpc_failing = False
        #: How often each non-success Mooncake code came back (-200 not stored, -704 miss, ...).
        self.code_counts: collections.Counter[int] = collections.Counter()

    # -- discovery / lifecycle -------------------------------------------------------------------

    @classmethod
    def unavailable_reason(cls, config: BackendConfig | None = None) -> str | None:
        """Checked by loading the module for real: the CUDA wheel installs on a CPU machine and
        only fails at import (libcuda), and the two wheels overwrite each other's files."""
        both = _installed(*WHEELS)
        if len(both) == len(WHEELS):
            return (
                f"both {' and '.join(both)} are installed; they write the same `mooncake` package, "
                f"so the extras mooncake and mooncake-cpu exclude each other: run "
                f"`pip uninstall -y {' '.join(WHEELS)}`, then install one of `{INSTALL}`"
            )
        try:
            importlib.import_module(STORE_MODULE)
        except ModuleNotFoundError:
            return f"module {STORE_MODULE!r} is not installed: run `{INSTALL}`"
        except Exception as exc:  # the CUDA wheel without libcuda raises ImportError or OSError
            wheel = f" (from {', '.join(both)})" if both else ""
            return (
                f"module {STORE_MODULE!r}{wheel} is installed but fails to load: "
                f"{type(exc).__name__}: {exc}; on a machine without CUDA use "
                f"`pip uninstall -y {WHEELS[0]} && pip install 'kvstrata[mooncake-cpu]'`"
            )
        return None

    def instance_capabilities(self) -> BackendCapabilities:
        """Standalone mode needs host pools from the backend's allocator (the client maps memfds)."""
        if self.config.standalone:
            return self.capabilities.model_copy(update={"host_allocator": True})
        return self.capabilities

    @property
    def _endpoint(self) -> tuple[str, str]:
        if self.config.standalone:
            return "mooncake_client", self.config.client
        return "mooncake_master", self.config.master

    def where(self) -> str | None:
        cfg = self.config
        if cfg.standalone:
            return (
                f"in the segment of the standalone mooncake_client {cfg.client} (master {cfg.master}): "
                "objects outlive this process, for as long as that client runs"
            )
        if cfg.segment_bytes == 0:
            return (
                f"this process contributes no memory: objects land in the segments of the other "
                f"clients of mooncake_master {cfg.master} and last as long as those clients run"
            )
        return (
            f"in this process's own segment ({cfg.segment_bytes / 2**30:g} GiB), registered with "
            f"mooncake_master {cfg.master}: embedded mode, the objects go when this process exits; "
            "to keep them across runs, start a mooncake_client and set standalone: true and client "
            "(docs/storage.md, 'Mooncake as L3')"
        )

    def probe(self) -> str | None:
        role, address = self._endpoint
        reason = answer_probe(address, self.config.connect_timeout_s)
        return None if reason is None else f"{role} unreachable: {reason}"

    def open(self) -> None:
        try:
            store_module = importlib.import_module(STORE_MODULE)
        except ImportError as exc:
            raise MissingDependencyError(
                "storage backend", self.name, STORE_MODULE, self.requires[STORE_MODULE]
            ) from exc
        # setup() holds the GIL and, against a dead or mute endpoint, retries for minutes: probe first.
        reason = self.probe()
        if reason is not None:
            raise StorageError(f"mooncake backend {self.instance!r}: {reason}")
        cfg = self.config
        self._export_deadlines()
        store = store_module.MooncakeDistributedStore()
        if cfg.standalone:
            what = f"setup_dummy to mooncake_client {cfg.client}"
            rc = store.setup_dummy(cfg.host_memory_limit_bytes or 0, cfg.local_buffer_bytes, cfg.client)
        else:
            what = f"setup against mooncake_master {cfg.master} (metadata {cfg.metadata_server})"
            rc = store.setup(
                cfg.local_hostname,
                cfg.metadata_server,
                cfg.segment_bytes,
                cfg.local_buffer_bytes,
                cfg.protocol,
                cfg.device_names,
                cfg.master,
            )
        if rc != 0:
            with contextlib.suppress(Exception):
                store.close()
            raise StorageError(f"mooncake backend {self.instance!r}: {what} returned {rc}")
        self._store = store
        try:
            if self._needs_registered_memory:
                self._staging = self._new_staging_area(cfg.staging_bytes)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Close the store -- unless its endpoint is silent (a stopped master or client): then
        ``store.close()`` would hold the GIL for its RPC retries (observed ~15 s with a 1 s RPC
        deadline), so the store is deliberately leaked with a warning, its destructor included
        (one extra reference), and the process goes on; the master drops it once the process
        exits and its heartbeats stop."""
        with self._state_lock:
            store, self._store = self._store, None
        if store is not None:
            role, address = self._endpoint
            # A refused connection makes close fail fast; only a silent endpoint makes it block.
            state, reason = check_endpoint(address, self.config.connect_timeout_s)
            if state is Endpoint.SILENT:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))
                _log.warning("mooncake backend %r: not closed cleanly: %s %s", self.instance, role, reason)
            else:
                try:
                    store.close()
                except Exception as exc:  # closing must not fail the caller's shutdown
                    _log.warning("mooncake backend %r: close failed: %s", self.instance, exc)
        self._staging = None
        self._staging_keepalive = None

    def _export_deadlines(self) -> None:
        """Mooncake reads its RPC deadlines from the environment when a client is set up."""
        if self.config.rpc_timeout_s is not None:
            os.environ["MC_RPC_TIMEOUT_MS"] = str(max(1, round(self.config.rpc_timeout_s * 1000)))
            os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] = str(max(1, round(self.config.connect_timeout_s * 1000)))

    @property
    def _needs_registered_memory(self) -> bool:
        """Whether Mooncake can only move bytes from registered (or, standalone, memfd) memory."""
        return self.config.standalone or self.config.protocol != "tcp"

    @property
    def native_store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (benchmarks compare against its raw calls)."""
        return self._live_store()

    def _live_store(self) -> Any:
        store = self._store
        if store is None:
            raise StorageError(f"mooncake backend {self.instance!r} is not open")
        return store

    def _new_staging_area(self, nbytes: int) -> BufferRegion:
        if self.config.standalone:
            return self.allocate_host_memory(nbytes, count_against_limit=False)
        buffer = ctypes.create_string_buffer(nbytes)
        region = BufferRegion(ctypes.addressof(buffer), nbytes)
        self._staging_keepalive = buffer
        self.register_host_memory(region)
        return region

    # -- host memory -----------------------------------------------------------------------------

    def allocate_host_memory(self, nbytes: int, *, count_against_limit: bool = True) -> BufferRegion:
        """Standalone mode: a new memfd region the mooncake_client maps, registered for zero-copy.

        Pools added after start get their own region, so the client's mapping always covers them;
        the only refusal is ``host_memory_limit_bytes`` or the OS failing the allocation.
        """
        cfg = self.config
        if not cfg.standalone:
            raise StorageError(
                f"mooncake backend {self.instance!r} allocates host memory only in standalone mode; "
                "in-process mode registers ordinary host memory (register_host_memory)"
            )
        if nbytes <= 0:
            raise StorageError(f"cannot allocate {nbytes} bytes of host memory: size must be positive")
        store = self._live_store()
        with self._state_lock:
            limit = cfg.host_memory_limit_bytes
            if count_against_limit and limit is not None and self._allocated_bytes + nbytes > limit:
                raise StorageError(
                    f"mooncake backend {self.instance!r}: cannot allocate {nbytes} bytes of host memory "
                    f"from mooncake_client {cfg.client}: {self._allocated_bytes} of "
                    f"host_memory_limit_bytes={limit} are already allocated "
                    f"({self._allocated_bytes + nbytes - limit} bytes short); raise "
                    "host_memory_limit_bytes or shrink the pool"
                )
            ptr = int(store.alloc_from_mem_pool(nbytes))
            if ptr == 0:
                raise StorageError(
                    f"mooncake backend {self.instance!r}: alloc_from_mem_pool({nbytes}) failed "
                    "(memfd creation or mapping refused: check free memory and the cgroup's shmem limit)"
                )
            rc = store.register_buffer(ptr, nbytes)
            if rc != 0:
                raise StorageError(
                    f"mooncake backend {self.instance!r}: mooncake_client {cfg.client} refused to map "
                    f"a new {nbytes}-byte region (register_buffer returned {rc})"
                )
            self._registered.add(ptr, nbytes)
            if count_against_limit:
                self._allocated_bytes += nbytes
        return BufferRegion(ptr, nbytes)

    def register_host_memory(self, region: BufferRegion) -> None:
        """Register a host pool; already-registered parts are skipped, so overlaps are harmless."""
        if region.nbytes <= 0:
            raise StorageError(f"cannot register an empty host-memory region at {region.ptr:#x}")
        store = self._live_store()
        with self._state_lock:
            if self._registered.covers(region.ptr, region.nbytes):
                return
            if self.config.standalone:
                raise StorageError(
                    f"mooncake backend {self.instance!r} is in standalone mode: host memory must come "
                    f"from allocate_host_memory (the mooncake_client maps only memfd regions it handed "
                    f"out); region {region.ptr:#x}+{region.nbytes} is not one of them"
                )
            for start, length in self._registered.gaps(region.ptr, region.nbytes):
                rc = store.register_buffer(start, length)
                if rc == INVALID_PARAMS:
                    # Registered by someone else in this process (overlap): usable as it is.
                    _log.debug("mooncake: %#x+%d already registered elsewhere", start, length)
                elif rc != 0:
                    raise StorageError(
                        f"mooncake backend {self.instance!r}: register_buffer({start:#x}, {length}) "
                        f"returned {rc}"
                    )
                self._registered.add(start, length)

    # -- data path -------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per-key presence. A negative code for one key counts as absent; when *every* key fails
        the backend itself is failing (master unreachable: ``-900``), which raises StorageError so
        the core does not mistake an outage for a cold cache."""
        if not keys:
            return []
        codes = self._call("batch_is_exist", list(keys))
        failed = [code for code in codes if code < 0]
        if failed:
            self.code_counts.update(failed)
            if len(failed) == len(codes):
                raise StorageError(
                    f"mooncake backend {self.instance!r}: batch_is_exist failed for all "
                    f"{len(codes)} keys (code {failed[0]})"
                )
        return [code == 1 for code in codes]

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        """Store objects; an existing key is left as it is (counts as stored); ``-200`` = not stored."""
        results = [False] * len(objects)
        for indexes, ptrs, sizes, staged in self._plan_batches(objects):
            with self._staging_guard(staged):
                for _, scratch, source, nbytes in staged:
                    ctypes.memmove(scratch, source, nbytes)
                codes = self._transfer("put", [objects[i].key for i in indexes], ptrs, sizes)
            for index, code in zip(indexes, codes, strict=True):
                results[index] = code == 0
                if code != 0:
                    self.code_counts[code] += 1
        return results

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        """Read objects into their regions; per key the bytes read, or the negative Mooncake code.

        ``-703`` (the replica is still being written, typically by a concurrent put of the same key
        whose second writer was already told "stored") is re-read after short waits, so a put that
        returned True is readable; only if it persists does the key report ``-703`` (a miss).

        An object shorter than its regions (truncated or foreign) makes Mooncake's multi-buffer
        read fail as a whole (``-800``); it is then re-read into the leading bytes of the regions so
        the caller sees a short read it can count as corruption, rather than an unexplained error.
        """
        results = self._get(objects)
        for delay in NOT_READY_BACKOFF_S:
            pending = [index for index, code in enumerate(results) if code == REPLICA_NOT_READY]
            if not pending:
                break
            time.sleep(delay)
            for index, code in zip(pending, self._get([objects[i] for i in pending]), strict=True):
                results[index] = code
        short = [
            index
            for index, code in enumerate(results)
            if code == TRANSFER_FAIL and len(objects[index].regions) > 1
        ]
        if short:
            sizes = [int(self._live_store().get_size(objects[index].key)) for index in short]
            retry = [
                (index, StorageObject(objects[index].key, leading_regions(objects[index].regions, size)))
                for index, size in zip(short, sizes, strict=True)
                if 0 < size < objects[index].nbytes
            ]
            if retry:
                codes = self._get([obj for _, obj in retry])
                for (index, _), code in zip(retry, codes, strict=True):
                    results[index] = code
        return results

    def _get(self, objects: Sequence[StorageObject]) -> list[int]:
        results = [STAGING_TOO_SMALL] * len(objects)
        for indexes, ptrs, sizes, staged in self._plan_batches(objects):
            with self._staging_guard(staged):
                codes = self._transfer("get", [objects[i].key for i in indexes], ptrs, sizes)
                for position, scratch, target, nbytes in staged:
                    if codes[position] >= 0:
                        ctypes.memmove(target, scratch, nbytes)
            for index, code in zip(indexes, codes, strict=True):
                results[index] = code
                if code < 0:
                    self.code_counts[code] += 1
        return results

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Forced ``batch_remove``: a reader's lease (held for a while after every get) must not keep
        a damaged object alive. ``-704`` (already gone) counts as removed."""
        if not keys:
            return []
        codes = self._call("batch_remove", list(keys), True)
        if len(codes) != len(keys):
            raise StorageError(
                f"mooncake backend {self.instance!r}: batch_remove answered {len(codes)} codes "
                f"for {len(keys)} keys"
            )
        self.code_counts.update(code for code in codes if code not in (0, OBJECT_NOT_FOUND))
        return [code in (0, OBJECT_NOT_FOUND) for code in codes]

    def corrupt_for_test(self, key: str, mode: Literal["flip", "truncate"], offset: int = -1) -> bool:
        """Test hook (conformance kit): replace ``key`` by a damaged copy, bit flipped or truncated.

        Mooncake never rewrites a key in place, so this reads the object, force-removes it (reads
        hold a lease) and stores the damaged bytes under the same key. Not for production use.
        """
        store = self._live_store()
        size = int(store.get_size(key))
        if size <= 0:
            return False
        buffer = ctypes.create_string_buffer(size)
        region = BufferRegion(ctypes.addressof(buffer), size)
        if self.get([StorageObject(key, (region,))]) != [size]:
            return False
        if mode == "flip":
            position = offset % size
            buffer[position] = bytes([buffer.raw[position] ^ 0xFF])
            damaged = region
        else:
            damaged = BufferRegion(region.ptr, max(1, size // 2 if offset < 0 else min(offset, size - 1)))
        if store.remove(key, True) != 0:
            return False
        return self.put([StorageObject(key, (damaged,))]) == [True]

    # -- helpers ---------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> list[int]:
        store = self._live_store()
        if self._rpc_failing:
            # The last call failed with RPC errors (each costs Mooncake's ~4 s timeout): while the
            # endpoint does not even accept TCP, fail in milliseconds instead.
            reason = self.probe()
            if reason is not None:
                raise StorageError(f"mooncake backend {self.instance!r}: {reason}; failing {method} fast")
        try:
            codes = list(getattr(store, method)(*args))
        except Exception as exc:  # a pybind error fails this operation, never the process
            raise StorageError(f"mooncake backend {self.instance!r}: {method} raised {exc!r}") from exc
        self._rpc_failing = bool(codes) and all(code <= RPC_FAIL for code in codes)
        if self._rpc_failing:
            self.code_counts.update(codes)
            role, address = self._endpoint
            raise StorageError(
                f"mooncake backend {self.instance!r}: {method} failed for all {len(codes)} keys "
                f"(code {codes[0]}): {role} {address} unreachable or not answering"
            )
        return codes

    def _transfer(
        self, direction: Literal["put", "get"], keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        if all(len(p) == 1 for p in ptrs):
            flat_ptrs = [p[0] for p in ptrs]
            flat_sizes = [s[0] for s in sizes]
            method = "batch_put_from" if direction == "put" else "batch_get_into"
            codes = self._call(method, keys, flat_ptrs, flat_sizes)
        else:
            method = "batch_put_from_multi_buffers" if direction == "put" else "batch_get_into_multi_buffers"
            codes = self._call(method, keys, ptrs, sizes)
        if len(codes) != len(keys):
            raise StorageError(
                f"mooncake backend {self.instance!r}: {method} answered {len(codes)} codes "
                f"for {len(keys)} keys"
            )
        return codes

    def _staging_guard(self, staged: list[_Staged]) -> contextlib.AbstractContextManager[Any]:
        return self._staging_lock if staged else contextlib.nullcontext()

    def _plan_batches(
        self, objects: Sequence[StorageObject]
    ) -> Iterator[tuple[list[int], list[list[int]], list[list[int]], list[_Staged]]]:
        """Yield (object indexes, ptr lists, size lists, staged copies) per Mooncake call.

        Staged copies are (position in this call, scratch ptr, original ptr, nbytes): regions
        Mooncake cannot read where they are. A batch is split when the staging area fills; an
        object whose unregistered bytes alone exceed the staging area is skipped (put: False;
        get: STAGING_TOO_SMALL).
        """
        if not self._needs_registered_memory:
            # In-process TCP reads any address: one call for the whole batch, no per-region checks.
            if any(not obj.regions for obj in objects):
                raise StorageError(f"mooncake backend {self.instance!r}: an object has no regions")
            if objects:
                yield (
                    list(range(len(objects))),
                    [[region.ptr for region in obj.regions] for obj in objects],
                    [[region.nbytes for region in obj.regions] for obj in objects],
                    [],
                )
            return
        staging = self._staging
        capacity = staging.nbytes if staging is not None else 0
        indexes: list[int] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        staged: list[_Staged] = []
        used = 0
        for index, obj in enumerate(objects):
            if not obj.regions:
                raise StorageError(f"mooncake backend {self.instance!r}: object {obj.key!r} has no regions")
            obj_ptrs = [region.ptr for region in obj.regions]
            obj_sizes = [region.nbytes for region in obj.regions]
            obj_staged = [
                (position, region.nbytes)
                for position, region in enumerate(obj.regions)
                if not self._registered.covers(region.ptr, region.nbytes)
            ]
            need = sum(_aligned(nbytes) for _, nbytes in obj_staged)
            if need and (staging is None or need > capacity):
                _log.warning(
                    "mooncake backend %r: object %r has %d unregistered bytes, more than staging_bytes=%d",
                    self.instance,
                    obj.key,
                    need,
                    capacity,
                )
                self.code_counts[STAGING_TOO_SMALL] += 1
                continue
            if need and used + need > capacity:
                yield indexes, ptrs, sizes, staged
                indexes, ptrs, sizes, staged, used = [], [], [], [], 0
            for position, nbytes in obj_staged:
                scratch = staging.ptr + used  # type: ignore[union-attr]
                staged.append((len(indexes), scratch, obj_ptrs[position], nbytes))
                obj_ptrs[position] = scratch
                used += _aligned(nbytes)
            indexes.append(index)
            ptrs.append(obj_ptrs)
            sizes.append(obj_sizes)
        if indexes:
            yield indexes, ptrs, sizes, staged


def _aligned(nbytes: int, alignment: int = 64) -> int:
    return (nbytes + alignment - 1) // alignment * alignment
