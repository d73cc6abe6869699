"""``file``: the embedded default backend, one file per object in a local directory.

Layout: ``{path}/{fan}/{key}`` where ``fan`` is the first ``fanout_chars`` hex digits of the
key's BLAKE2b digest (spreads objects over 256 sub-directories by default). Keys longer than
200 characters or with unsafe characters are stored under their digest instead.

Safety with several processes sharing the directory:

* writes are two-phase: a temp file ``.{name}.tmp-{pid}-{token}-{serial}`` in the same
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
(updated on every hit, put and exists). Temp files of writers that died (kill -9, power loss) are removed at
open once older than ``stale_temp_s``; younger ones (a writer may be alive) count against the
capacity until they vanish or grow stale.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, field_validator

from kvstrata.plugins.storage_backend import (
    ANY_POOL,
    OBJECT_MAGIC,
    BackendCapabilities,
    BackendConfig,
    PoolCapabilities,
    ReadCheck,
    StorageBackend,
    StorageObject,
    region_views,
)

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_TMP_MARK = ".tmp-"
#: A temp file of this backend: ``.{object name}.tmp-{pid}-{8 hex}-{serial}``.
_TMP_NAME = re.compile(r"^\.(?P<name>[A-Za-z0-9_.-]{1,200})\.tmp-\d+-[0-9a-f]{8}-\d+$")
_DIGEST_NAME = re.compile(r"^[0-9a-f]{32}$")
_HEX = frozenset("0123456789abcdef")
#: Less free space than this on the directory's file system: the backend reports itself unusable.
MIN_FREE_BYTES = 64 << 20

#: Most platforms cap one readv/writev at 1024 iovecs (IOV_MAX).
_IOV_MAX = 1024
MISS = -1
#: Fewest objects worth handing to another I/O thread (below that, dispatch costs more than it saves).
_MIN_CHUNK = 8
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)  # no O_NOATIME: atime seeds the LRU
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
log = logging.getLogger(__name__)
_T = TypeVar("_T")
_R = TypeVar("_R")


class FileConfig(BackendConfig):
    """Config of the ``file`` backend (all field names are what users write)."""

    type: Literal["file"] = "file"
    path: Path = Field(description="directory holding the objects (created if missing)")
    capacity_bytes: int | None = Field(default=None, ge=1, description="LRU-evict above this size")
    io_threads: int = Field(default=4, ge=1, le=64, description="parallel file operations per batch")
    fsync: bool = Field(default=False, description="fsync each object before it becomes visible")
    fanout_chars: int = Field(default=2, ge=0, le=4, description="hex digits of sub-directory fan-out")
    stale_temp_s: float = Field(
        default=600.0,
        gt=0,
        description="age after which a temp file of a dead writer is removed at open (younger: counted)",
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

    @field_validator("path", mode="before")
    @classmethod
    def _path_not_empty(cls, value: object) -> object:
        """An empty path would silently mean the current directory, whatever else it holds."""
        if isinstance(value, str) and not value.strip():
            raise ValueError("must name a directory (an empty path would mean the current directory)")
        return value


def _advance(pending: list[memoryview], done: int) -> list[memoryview]:
    """``pending`` less its first ``done`` bytes: the views fully done dropped in one slice, the
    next one cut where the transfer stopped."""
    index = 0
    while index < len(pending) and done >= len(pending[index]):
        done -= len(pending[index])
        index += 1
    if done:
        return [pending[index][done:], *pending[index + 1 :]]
    return pending[index:]


def _write_all(fd: int, views: list[memoryview]) -> None:
    """``os.writev`` until every byte is written (it may write less than asked)."""
    pending = views
    while pending:
        pending = _advance(pending, os.writev(fd, pending[:_IOV_MAX]))


def _has_magic(path: str, fd: int | None = None) -> bool:
    """Whether the file starts with the object magic: the proof that this backend wrote it."""
    try:
        if fd is not None:
            return os.pread(fd, len(OBJECT_MAGIC), 0) == OBJECT_MAGIC
        handle = os.open(path, _READ_FLAGS)
    except OSError:
        return False
    try:
        return os.pread(handle, len(OBJECT_MAGIC), 0) == OBJECT_MAGIC
    except OSError:
        return False
    finally:
        os.close(handle)


def _fsync_directory(directory: str) -> bool:
    """fsync a directory, so the renames and creations in it survive a power loss."""
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError:
        return False
    try:
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        with contextlib.suppress(OSError):
            return max(1, len(affinity(0)))
    return max(1, os.cpu_count() or 1)


def _read_all(fd: int, views: list[memoryview]) -> int:
    """``os.readv`` until the regions are full or EOF; returns the bytes read."""
    total = 0
    pending = views
    while pending:
        got = os.readv(fd, pending[:_IOV_MAX])
        if got == 0:
            break
        total += got
        pending = _advance(pending, got)
    return total


class _Entry:
    """What the index knows of one object: its directory, its size, and when (monotonic clock)
    this process last saw it on disk (opened, wrote, stat-ed, or found at open)."""

    __slots__ = ("directory", "seen", "size")

    def __init__(self, directory: str, size: int, seen: float) -> None:
        self.directory = directory
        self.size = size
        self.seen = seen


class FileBackend(StorageBackend):
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
        self.root = Path(self.config.path)
        # Paths are plain strings on the data path: pathlib costs more than the syscalls it wraps.
        self._root = os.fspath(self.root)
        #: The index: object file name (the key, or its digest) -> entry, least recently used first.
        #: ``exists`` answers from it without a syscall; it is also the LRU of the capacity.
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._temps: dict[str, int] = {}  # other writers' live temp files: path -> bytes counted
        self._used = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._tmp_prefix = f"{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self._tmp_serial = itertools.count()  # next() is atomic under the GIL
        #: Abandoned temp files (of writers that died) removed at open or under capacity pressure.
        self.stale_temps_removed = 0
        #: Object names being read by this process: never recycled while a read may be under way.
        self._reading: dict[str, int] = {}
        #: Whether every read of this instance is checksum-verified (the core says so through
        #: ``set_read_verification``): the condition for recycling evicted files, since a reader
        #: in another process that opened a file before it was recycled may read a mix of two
        #: objects, which only the checksum turns into a miss.
        self._reads_verified = False
        self.recycled_files = 0  # puts written into an evicted object's file
        #: Threads a get uses: a read from the page cache is a memory copy (and its checksum) that
        #: keeps a core busy, so threads beyond the cores this process may run on only add GIL
        #: hand-offs (measured: 4 threads on 2 cores read 10-15% slower than 2). Writes wait on
        #: the file system (create, rename) and keep every ``io_threads``.
        self._read_threads = min(self.config.io_threads, _usable_cpus())

    # --- lifecycle ----------------------------------------------------------------------------

    def open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._adopt_existing()
        self._pool = ThreadPoolExecutor(
            self.config.io_threads, thread_name_prefix=f"kvstrata-file-{self.instance}"
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def probe(self) -> str | None:
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

    def _layout_dirs(self) -> list[tuple[str, str]]:
        """``(directory, fan)`` of every directory of this backend's layout that exists: the
        fan-out sub-directories (exactly ``fanout_chars`` lowercase hex digits), or the root."""
        width = self.config.fanout_chars
        if width == 0:
            return [(self._root, "")]
        try:
            entries = list(os.scandir(self._root))
        except FileNotFoundError:
            return []
        return [
            (f"{self._root}/{entry.name}", entry.name)
            for entry in entries
            if len(entry.name) == width
            and _HEX.issuperset(entry.name)
            and entry.is_dir(follow_symlinks=False)
        ]

    def _in_layout(self, fan: str, name: str) -> bool:
        """Whether this backend would store an object named ``name`` in fan-out directory ``fan``:
        a key stored under its own name, or under its digest."""
        if name.startswith(".") or not _SAFE_NAME.match(name):
            return False
        width = self.config.fanout_chars
        if _DIGEST_NAME.match(name) and name[:width] == fan:
            return True
        return hashlib.blake2b(name.encode(), digest_size=16).hexdigest()[:width] == fan

    def _adopt_existing(self) -> None:
        """Build the index from this backend's objects already there (restart, or written by other
        processes), oldest first; remove abandoned temp files and count live ones. A file outside
        the layout, or without the object magic, is not ours: it is never counted nor touched."""
        now = time.time()
        found: list[tuple[float, str, str, int]] = []
        for directory, fan in self._layout_dirs():
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            directory = sys.intern(directory)  # one string per directory, shared by its entries
            for entry in entries:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                temp = _TMP_NAME.match(entry.name)
                if temp is not None:
                    if self._in_layout(fan, temp["name"]):
                        self._temp_found(f"{directory}/{entry.name}", info.st_size, now - info.st_mtime)
                elif self._in_layout(fan, entry.name) and _has_magic(f"{directory}/{entry.name}"):
                    found.append((max(info.st_atime, info.st_mtime), entry.name, directory, info.st_size))
        found.sort(key=lambda item: item[0])
        seen = time.monotonic()
        with self._lock:
            for _time, name, directory, size in found:
                if name not in self._index:
                    self._index[name] = _Entry(directory, size, seen)
                    self._used += size

    def _temp_found(self, path: str, size: int, age_s: float) -> None:
        """Another writer's temp file: removed when stale (its writer died), else counted."""
        if age_s > self.config.stale_temp_s:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            except OSError as exc:
                log.warning("file backend %r: cannot remove stale temp file %s: %s", self.instance, path, exc)
                return
            with self._lock:
                self.stale_temps_removed += 1
            return
        with self._lock:
            if path not in self._temps:
                self._temps[path] = size
                self._used += size

    def _settle_temps(self) -> None:
        """Re-check counted temp files under capacity pressure: gone ones (renamed by their live
        writer, whose object is then adopted on first touch) stop counting, stale ones are removed."""
        with self._lock:
            temps = list(self._temps.items())
        now = time.time()
        for path, size in temps:
            try:
                age_s = now - os.stat(path).st_mtime
            except FileNotFoundError:
                age_s = None
            if age_s is not None and age_s <= self.config.stale_temp_s:
                continue
            with self._lock:
                if self._temps.pop(path, None) is not None:
                    self._used -= size
            if age_s is not None:
                self._temp_found(path, size, age_s)

    # --- paths and the index ------------------------------------------------------------------

    def _locate(self, key: str) -> tuple[str, str]:
        """``(directory, file name)`` of ``key``: the name is the key itself when it is a safe file
        name, else its digest; the directory is picked by the digest (fan-out)."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        name = key if _SAFE_NAME.match(key) and not key.startswith(".") else digest
        fan = digest[: self.config.fanout_chars]
        return (sys.intern(f"{self._root}/{fan}") if fan else self._root), name

    def _lookup(self, key: str) -> tuple[str, str, _Entry | None]:
        """``(directory, name, index entry or None)``; a key the index holds costs no hashing."""
        entry = self._index.get(key)
        if entry is not None:
            return entry.directory, key, entry
        directory, name = self._locate(key)
        return directory, name, (self._index.get(name) if name != key else None)

    def _path(self, key: str) -> str:
        directory, name = self._locate(key)
        return f"{directory}/{name}"

    def path_for(self, key: str) -> Path:
        """Where ``key`` lives (also used by tests to corrupt objects on purpose)."""
        return Path(self._path(key))

    def _seen(self, names: Sequence[str]) -> None:
        """Objects just proven on disk (read, written, stat-ed): most recently used, seen now."""
        now = time.monotonic()
        index = self._index
        with self._lock:
            for name in names:
                entry = index.get(name)
                if entry is not None:
                    entry.seen = now
                    index.move_to_end(name)

    def _adopt(self, directory: str, name: str, size: int, fd: int | None = None) -> None:
        """Index an object another process wrote at a key's path, once its magic proves it ours."""
        if not _has_magic(f"{directory}/{name}", fd):
            return
        with self._lock:
            if name not in self._index:
                self._index[name] = _Entry(directory, size, time.monotonic())
                self._used += size

    def _forget(self, name: str) -> None:
        with self._lock:
            entry = self._index.pop(name, None)
            if entry is not None:
                self._used -= entry.size

    def set_read_verification(self, verified: bool) -> None:
        self._reads_verified = verified

    def _reserve(self, nbytes: int) -> tuple[bool, str | None]:
        """Evict least recently used objects until ``nbytes`` more fit under the capacity.

        Returns whether it fits and, when recycling, the path of one evicted file of exactly
        ``nbytes`` that the caller rewrites instead of creating a file (it is not unlinked):
        on a VM whose freed memory goes back to the host (free page reporting), a write into
        freshly allocated page-cache memory ran at 0.1-0.3 GiB/s here, into a recycled file's
        pages at 1-1.8 GiB/s."""
        capacity = self.config.capacity_bytes
        if capacity is None:
            with self._lock:
                self._used += nbytes
            return True, None
        if nbytes > capacity:
            return False, None
        if self._temps and self._used + nbytes > capacity:
            self._settle_temps()
        victims: list[str] = []
        recycled: str | None = None
        recycle = self.config.recycle_evicted and self._reads_verified
        with self._lock:
            while self._used + nbytes > capacity and self._index:
                name, entry = self._index.popitem(last=False)
                self._used -= entry.size
                if recycle and recycled is None and entry.size == nbytes and name not in self._reading:
                    recycled = f"{entry.directory}/{name}"
                else:
                    victims.append(f"{entry.directory}/{name}")
            self._used += nbytes  # reserved; corrected by _release on failure
        for path in victims:
            with contextlib.suppress(FileNotFoundError):  # another process may have removed it
                os.unlink(path)
        return True, recycled

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes counted against the capacity: known objects, in-flight writes, live temp files."""
        return self._used

    # --- I/O ----------------------------------------------------------------------------------

    def _map_rows(self, fn: Callable[[int, int], list[_R]], count: int, threads: int = 0) -> list[_R]:
        """``fn(start, stop)`` over ``range(count)`` on the I/O threads (at most ``threads``,
        0: ``io_threads``), one contiguous chunk per thread (the calling thread works the first):
        a future per item would cost more than reading a page from the page cache."""
        if self._pool is None:
            raise RuntimeError(f"file backend {self.instance!r} is not open")
        chunks = min(threads or self.config.io_threads, count // _MIN_CHUNK)
        if chunks <= 1:
            return fn(0, count)
        bounds = [count * index // chunks for index in range(chunks + 1)]
        futures = [self._pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, chunks)]
        results = fn(bounds[0], bounds[1])  # this thread works too instead of waiting idle
        for future in futures:
            results.extend(future.result())
        return results

    def _map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        return self._map_rows(lambda start, stop: [fn(item) for item in items[start:stop]], len(items))

    def exists(self, keys: Sequence[str], leading: bool = False) -> list[bool]:
        """From the index, without a syscall, for objects this process saw on disk within
        ``exists_recheck_s``; every other key (unknown here: possibly written by another process,
        or seen too long ago: possibly removed by one) is checked on disk.

        ``leading``: keys are checked in order on this thread and the first missing one ends the
        answer (the rest read False): a prefix query then costs the stats of its present keys
        plus one, and no worker hop, which costs more than a ``stat`` of a cached dentry."""
        cutoff = time.monotonic() - self.config.exists_recheck_s
        if leading:
            return self._leading(keys, cutoff)
        found = [False] * len(keys)
        unknown: list[int] = []
        index = self._index
        with self._lock:
            for position, key in enumerate(keys):
                entry = index.get(key)
                if entry is not None and entry.seen > cutoff:
                    index.move_to_end(key)
                    found[position] = True
                else:
                    unknown.append(position)
        if unknown:
            on_disk = self._map(
                lambda key: self._exists_by_name(key, cutoff), [keys[position] for position in unknown]
            )
            for position, present in zip(unknown, on_disk, strict=True):
                found[position] = present
        return found

    def _leading(self, keys: Sequence[str], cutoff: float) -> list[bool]:
        found = [False] * len(keys)
        index = self._index
        for position, key in enumerate(keys):
            with self._lock:
                entry = index.get(key)
                if entry is not None and entry.seen > cutoff:
                    index.move_to_end(key)
                    found[position] = True
                    continue
            if not self._exists_by_name(key, cutoff):
                break
            found[position] = True
        return found

    def _exists_by_name(self, key: str, cutoff: float) -> bool:
        """A key the index does not hold under its own name: stored under its digest (an unsafe
        key; still no syscall when the index holds that), else checked on disk."""
        directory, name, entry = self._lookup(key)
        if entry is not None and entry.seen > cutoff:
            with self._lock:
                if name in self._index:
                    self._index.move_to_end(name)  # used now; not proven on disk now
            return True
        try:
            size = os.stat(f"{directory}/{name}").st_size
        except FileNotFoundError:
            if entry is not None:
                self._forget(name)  # removed by another process
            return False
        if entry is None:
            self._adopt(directory, name, size)
        else:
            self._seen((name,))
        return True

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        stored = self._map(self._put_one, objects)
        if self.config.fsync:
            self._sync_directories(objects, stored)
        return stored

    def _sync_directories(self, objects: Sequence[StorageObject], stored: list[bool]) -> None:
        """fsync mode: a rename is durable only once its directory is. One fsync per directory
        per batch; an object whose directory cannot be synced reports not stored."""
        directories = [self._lookup(obj.key)[0] for obj in objects]
        failed = {d for d in set(directories) if not _fsync_directory(d)}
        if failed:
            for index, directory in enumerate(directories):
                if directory in failed:
                    stored[index] = False

    def _put_one(self, obj: StorageObject) -> bool:
        # Always stat, even for a key the index holds: a put that answers True must leave the
        # object on disk, and another process may have removed it since this one saw it.
        directory, name, entry = self._lookup(obj.key)
        path = f"{directory}/{name}"
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            if entry is not None:
                self._forget(name)
        else:
            if entry is None:
                self._adopt(directory, name, size)
            else:
                self._seen((name,))
            return True  # skip_existing: equal keys carry equal bytes
        nbytes = obj.nbytes
        fits, recycled = self._reserve(nbytes)
        if not fits:
            return False
        tmp = f"{directory}/.{name}{self._tmp_prefix}{next(self._tmp_serial)}"
        try:
            fd = self._open_temp(tmp, directory, recycled)
            try:
                _write_all(fd, region_views(obj.regions))
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            self._release(nbytes)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        with self._lock:
            known = self._index.get(name)
            if known is not None:  # adopted meanwhile: do not count twice
                self._used -= nbytes
                known.seen = time.monotonic()
            else:
                self._index[name] = _Entry(directory, nbytes, time.monotonic())
        return True

    def _open_temp(self, tmp: str, directory: str, recycled: str | None) -> int:
        """A write descriptor on the new temp file ``tmp``: the ``recycled`` evicted file renamed
        there (same size: the write covers every byte), else a file created."""
        if recycled is not None:
            for attempt in range(2):
                try:
                    os.rename(recycled, tmp)
                except FileNotFoundError:  # no fan-out directory yet, or removed by another process
                    if attempt or os.path.isdir(directory):
                        break
                    self._make_directory(directory)
                    continue
                except OSError:
                    break
                self.recycled_files += 1  # += is not atomic across threads: a statistic only
                return os.open(tmp, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            with contextlib.suppress(OSError):
                os.unlink(recycled)
        try:
            return os.open(tmp, _CREATE_FLAGS, 0o644)
        except FileNotFoundError:  # first object of this fan-out directory
            self._make_directory(directory)
            return os.open(tmp, _CREATE_FLAGS, 0o644)

    def _make_directory(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        if self.config.fsync and not _fsync_directory(directory.rpartition("/")[0]):
            raise OSError(f"cannot fsync the parent of {directory}") from None

    def get(self, objects: Sequence[StorageObject], check: ReadCheck | None = None) -> list[int]:
        """Read each object into its regions; ``check(row, nbytes)`` (see the plugin API) runs in
        the I/O thread that read object ``row``, right after it was read."""
        keys = [obj.key for obj in objects]
        reading = self._reading
        with self._lock:  # a file being read here is not recycled meanwhile (see _reserve)
            for key in keys:
                reading[key] = reading.get(key, 0) + 1
        try:
            return self._map_rows(
                lambda start, stop: self._get_rows(objects, start, stop, check),
                len(objects),
                self._read_threads,
            )
        finally:
            with self._lock:
                for key in keys:
                    left = reading.pop(key) - 1
                    if left:
                        reading[key] = left

    def _get_rows(
        self, objects: Sequence[StorageObject], start: int, stop: int, check: ReadCheck | None
    ) -> list[int]:
        results: list[int] = []
        known: list[str] = []
        for row in range(start, stop):
            got = self._get_one(objects[row], known)
            if check is not None and got >= 0:
                check(row, got)
            results.append(got)
        if known:
            self._seen(known)  # one lock for the chunk, not one per object
        return results

    def _get_one(self, obj: StorageObject, known: list[str]) -> int:
        directory, name, entry = self._lookup(obj.key)
        try:
            fd = os.open(f"{directory}/{name}", _READ_FLAGS)
        except FileNotFoundError:
            if entry is not None:
                self._forget(name)
            return MISS
        except OSError as exc:
            return -(exc.errno or 1)
        try:
            got = _read_all(fd, region_views(obj.regions))
            if entry is None:  # written by another process after open: adopt, real size
                self._adopt(directory, name, os.fstat(fd).st_size, fd)
            else:
                known.append(name)
        except OSError as exc:
            return -(exc.errno or 1)
        finally:
            os.close(fd)
        return got

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Unlink objects (an absent one counts as removed); frees their LRU accounting."""
        return self._map(self._remove_one, keys)

    def _remove_one(self, key: str) -> bool:
        directory, name, _entry = self._lookup(key)
        self._forget(name)
        try:
            os.unlink(f"{directory}/{name}")
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

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
