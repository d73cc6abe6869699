"""``file``: the embedded default backend, one file per object in a local directory.

Layout: ``{path}/{fan}/{key}`` where ``fan`` is the first ``fanout_chars`` hex digits of the
key's BLAKE2b digest (spreads objects over 256 sub-directories by default). Keys longer than
200 characters or with unsafe characters are stored under their digest instead.

Safety with several processes sharing the directory:

* writes are two-phase: a temp file ``.{name}.tmp-{pid}-{host tag}{token}-{serial}`` in the same
  sub-directory is written with ``os.writev`` straight from the object's regions, optionally
  ``fsync``-ed, then ``os.replace``-d onto the final name (and, with ``fsync``, the directory is
  fsync-ed too), so a reader sees a complete object or none;
* an existing key is not rewritten (skip), since equal keys carry equal bytes;
* eviction and reads tolerate files that another process removed meanwhile;
* a truncated file reads short and the core's header/length check turns it into a miss.

Safety for what else lives in ``path``: the backend only ever adopts, evicts or sweeps files it
can prove are its own -- a file in its layout (a fan-out sub-directory named by the digest of the
file's name, or the root without fan-out) that starts with the object magic, or a temp file named
as this backend names them. Everything else in the directory is never counted, evicted or removed.

The index: every object this process knows (file name -> directory, size, when it was last seen
on disk), in LRU order. It is built at open from the objects already there (oldest
access/modification time first) and kept by put, get, eviction and remove, so ``exists`` answers
objects seen within ``exists_recheck_s`` without a syscall -- the per-key ``stat`` (and the
digest of the key to find its path) was most of what an existence query cost. A key the index
does not hold is always checked on disk: the directory is shared, and an object another process
wrote after open is found (and adopted), never hidden. An entry seen longer ago is checked on
disk again, since another process's eviction may have removed it.

Capacity: ``capacity_bytes`` bounds what this process keeps, evicting in the index's LRU order
(updated on every hit, put and exists); an instance that never puts (vLLM's scheduler side)
forgets its least recently used entries past it. Temp files of writers that died (kill -9, power
loss) are removed at open when their writer was a process of this host that is gone, or once
older than ``stale_temp_s``; younger ones (a writer may be alive) count against the capacity
until they vanish or grow stale.

The parts: ``_file_config.py`` (the config model), ``_file_index.py`` (the index, adoption,
temp files, capacity), ``_file_io.py`` (the data path); this module is the plugin contract.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from pathlib import Path
from typing import Literal

from kvstrata.plugins.errors import StorageError
from kvstrata.plugins.storage_backend import (
    ANY_POOL,
    BackendCapabilities,
    BackendConfig,
    PoolCapabilities,
    StorageBackend,
)
from kvstrata.storage_backends._file_config import FileConfig
from kvstrata.storage_backends._file_io import MISS, FileIO, _fsync_directory, _usable_cpus
from kvstrata.storage_backends._io_threads import IOThreads

#: Less free space than this on the directory's file system: the backend reports itself unusable.
MIN_FREE_BYTES = 64 << 20


class FileBackend(FileIO, StorageBackend):
    name = "file"
    Config = FileConfig
    capabilities = BackendCapabilities(
        pools={ANY_POOL: PoolCapabilities(zero_copy=True)},
        batch_exists=True,
        multi_buffer_objects=True,
        atomic_visibility=True,
        overwrite="skip_existing",
        persistent=True,
        shared_across_instances=True,
        self_evicting=True,
        removable=True,
        checks_reads=True,
    )

    config: FileConfig

    def __init__(self, instance: str, config: BackendConfig) -> None:
        super().__init__(instance, config)
        self._init_index(Path(self.config.path))
        self._pool: IOThreads | None = None
        self._tmp_serial = itertools.count()  # next() is atomic under the GIL
        self.recycled_files = 0  # puts written into an evicted object's file
        #: Threads a get uses: a read from the page cache is a memory copy (and its checksum) that
        #: keeps a core busy, so threads beyond the cores this process may run on only add GIL
        #: hand-offs (measured: 4 threads on 2 cores read 10-15% slower than 2). Writes wait on
        #: the file system (create, rename) and keep every ``io_threads``.
        self._read_threads = min(self.config.io_threads, _usable_cpus())

    def open(self) -> None:
        # fsync mode: the directories this open creates are entries of their parents, which must
        # be durable too, else a power loss can take the whole store with the root's entry
        created = [d for d in (self.root, *self.root.parents) if not d.exists()] if self.config.fsync else []
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # say which directory and why, not a bare errno from pathlib
            raise StorageError(
                f"file backend {self.instance!r}: cannot create {self.root}: {exc.strerror or exc}"
            ) from exc
        for directory in created:
            if not _fsync_directory(os.fspath(directory.parent)):
                raise StorageError(f"file backend {self.instance!r}: cannot fsync {directory.parent}")
        self._adopt_existing()
        self._pool = IOThreads(self.config.io_threads, f"kvstrata-file-{self.instance}")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def probe(self) -> str | None:
        """Whether the directory can be created and written, by doing both (permission bits do
        not tell). A diagnostic must not create what it checks (``doctor`` left an empty L3
        directory behind): the directories this probe created are removed again, deepest first,
        only those and only while empty (``open`` creates them for a run)."""
        created = [d for d in (self.root, *self.root.parents) if not d.exists()]
        try:
            return self._probe_root()
        finally:
            for directory in created:
                with contextlib.suppress(OSError):  # not empty (another process's files): kept
                    directory.rmdir()

    def _probe_root(self) -> str | None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"cannot create {self.root}: {exc.strerror or exc}"
        if not os.access(self.root, os.W_OK | os.X_OK):
            return f"directory {self.root} is not writable"
        # Permission bits do not tell (root passes them; a read-only mount does not): write one
        # temp file, named as this backend names its own, and remove it again.
        probe = f"{self.root}/{self._tmp_prefix}probe"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:
            return f"directory {self.root} is not writable: {exc.strerror or exc}"
        with contextlib.suppress(OSError):
            os.unlink(probe)
        free = shutil.disk_usage(self.root).free
        if free < MIN_FREE_BYTES:
            return (
                f"only {free / 2**20:.1f} MiB free on the file system of {self.root} "
                f"(at least {MIN_FREE_BYTES // 2**20} MiB needed to store anything)"
            )
        return None

    # --- test hooks -----------------------------------------------------------------------------

    def corrupt_for_test(self, key: str, mode: Literal["flip", "truncate"], offset: int = -1) -> bool:
        """Damage a stored object on purpose (conformance kit): flip one byte or cut it in half."""
        path = self.path_for(key)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return False
        if mode == "truncate":
            os.truncate(path, size // 2)
            return True
        with open(path, "r+b") as handle:
            handle.seek(offset % size)
            byte = handle.read(1)
            handle.seek(offset % size)
            handle.write(bytes([byte[0] ^ 0xFF]))
        return True


__all__ = ["MIN_FREE_BYTES", "MISS", "FileBackend", "FileConfig"]
