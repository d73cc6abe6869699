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
TCP-probes the endpoint before each call and fails in milliseconds while it is down); ``-10xx`` =
a master in failover. A batch in which every key failed with one of those raises
:class:`StorageError`: an outage is a failed call
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

The parts: ``_mooncake_config.py`` (the config model), ``_mooncake_protocol.py`` (return codes,
endpoint probes), ``_mooncake_memory.py`` (registered memory, staging, batch plans),
``_mooncake_io.py`` (the data path); this module is the plugin contract and the lifecycle.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import importlib.metadata
import logging
import os
from typing import Any, Literal

from kvstrata.plugins.errors import MissingDependencyError, StorageError
from kvstrata.plugins.storage_backend import (
    ANY_POOL,
    BackendCapabilities,
    BackendConfig,
    BufferRegion,
    PoolCapabilities,
    StorageBackend,
    StorageObject,
)
from kvstrata.storage_backends._mooncake_config import MIN_SEGMENT_BYTES, MooncakeConfig
from kvstrata.storage_backends._mooncake_io import MooncakeIO
from kvstrata.storage_backends._mooncake_protocol import (
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    NOT_READY_BACKOFF_S,
    OBJECT_NOT_FOUND,
    REPLICA_NOT_READY,
    RPC_FAIL,
    STAGING_TOO_SMALL,
    TRANSFER_FAIL,
    Endpoint,
    answer_probe,
    check_endpoint,
    tcp_probe,
)

#: The command that installs the wheel for this machine, runnable as printed: the CUDA wheel
#: (extra ``mooncake``) needs the NVIDIA driver's libcuda, which a machine without the driver's
#: device node lacks (extra ``mooncake-cpu`` there).
INSTALL = (
    "pip install 'kvstrata[mooncake]'"
    if os.path.exists("/dev/nvidiactl")
    else "pip install 'kvstrata[mooncake-cpu]'"
)
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


_log = logging.getLogger(__name__)

#: how long ``close`` waits for native calls still running (each ends by its RPC deadline)
CLOSE_WAIT_S = 30.0


class MooncakeBackend(MooncakeIO, StorageBackend):
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
        self._init_memory()
        self._store: Any = None
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
                f"`pip uninstall -y {' '.join(WHEELS)}`, then `{INSTALL}`"
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
        """Close the store -- unless its endpoint does not answer (a stopped or killed master or
        client): then ``store.close()`` would hold the GIL for its RPC retries (observed ~15 s
        with a 1 s RPC deadline for a stopped master; ~10 s for one killed a few seconds
        earlier, refusing connections), so the store is deliberately leaked with a warning, its
        destructor included (one extra reference), and the process goes on; the master drops
        it once the process exits and its heartbeats stop. Its native threads run until then,
        and Mooncake's exit handler still tears it down at process exit (~10 s there for a
        killed master: docs/storage.md)."""
        store = self._detach_store()
        if store is not None:
            role, address = self._endpoint
            state, reason = check_endpoint(address, self.config.connect_timeout_s)
            if state is not Endpoint.ANSWERS:
                problem: str | None = f"{role} {reason}"
            elif not self._calls_ended(CLOSE_WAIT_S):  # closing under a running call crashes
                problem = f"native calls still running after {CLOSE_WAIT_S:g} s"
            else:
                problem = None
            if problem is not None:
                for leaked in (store, self._staging_keepalive):  # (a running call may still use both)
                    if leaked is not None:
                        ctypes.pythonapi.Py_IncRef(ctypes.py_object(leaked))
                _log.warning("mooncake backend %r: not closed cleanly: %s", self.instance, problem)
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
    def native_store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (benchmarks compare against its raw calls)."""
        return self._live_store()

    def _live_store(self) -> Any:
        store = self._store
        if store is None:
            raise StorageError(f"mooncake backend {self.instance!r} is not open")
        return store

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


__all__ = [
    "INSTALL",
    "INVALID_PARAMS",
    "MIN_SEGMENT_BYTES",
    "NOT_READY_BACKOFF_S",
    "NO_AVAILABLE_HANDLE",
    "OBJECT_NOT_FOUND",
    "REPLICA_NOT_READY",
    "RPC_FAIL",
    "STAGING_TOO_SMALL",
    "STORE_MODULE",
    "TRANSFER_FAIL",
    "WHEELS",
    "Endpoint",
    "MooncakeBackend",
    "MooncakeConfig",
    "answer_probe",
    "check_endpoint",
    "tcp_probe",
]
