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

Capacity: ``capacity_bytes`` bounds what this process keeps; the LRU order lives in memory,
seeded at open from the objects already there (oldest access/modification time first), updated on
every hit, put and exists. Objects written by other processes after open are adopted when this
process first touches them. Temp files of writers that died (kill -9, power loss) are removed at
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

    @field_validator("path", mode="before")
    @classmethod
    def _path_not_empty(cls, value: object) -> object:
        """An empty path would silently mean the current directory, whatever else it holds."""
        if isinstance(value, str) and not value.strip():
            raise ValueError("must name a directory (an empty path would mean the current directory)")
        return value


def _apply(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    return [fn(item) for item in items]


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
    )

    config: FileConfig

    def __init__(self, instance: str, config: BackendConfig) -> None:
        super().__init__(instance, config)
        self.root = Path(self.config.path)
        # Paths are plain strings on the data path: pathlib costs more than the syscalls it wraps.
        self._root = os.fspath(self.root)
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._temps: dict[str, int] = {}  # other writers' live temp files: path -> bytes counted
        self._used = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._tmp_prefix = f"{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self._tmp_serial = itertools.count()  # next() is atomic under the GIL
        #: Abandoned temp files (of writers that died) removed at open or under capacity pressure.
        self.stale_temps_removed = 0

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
        """Seed the LRU with this backend's objects already there (restart, or written by other
        processes), oldest first; remove abandoned temp files and count live ones. A file outside
        the layout, or without the object magic, is not ours: it is never counted nor touched."""
        now = time.time()
        found: list[tuple[float, str, int]] = []
        for directory, fan in self._layout_dirs():
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                path = f"{directory}/{entry.name}"
                temp = _TMP_NAME.match(entry.name)
                if temp is not None:
                    if self._in_layout(fan, temp["name"]):
                        self._temp_found(path, info.st_size, now - info.st_mtime)
                elif self._in_layout(fan, entry.name) and _has_magic(path):
                    found.append((max(info.st_atime, info.st_mtime), path, info.st_size))
        found.sort(key=lambda item: item[0])
        with self._lock:
            for _time, path, size in found:
                if path not in self._lru:
                    self._lru[path] = size
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

    # --- paths and LRU ------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        name = key if _SAFE_NAME.match(key) and not key.startswith(".") else digest
        fan = digest[: self.config.fanout_chars]
        return f"{self._root}/{fan}/{name}" if fan else f"{self._root}/{name}"

    def path_for(self, key: str) -> Path:
        """Where ``key`` lives (also used by tests to corrupt objects on purpose)."""
        return Path(self._path(key))

    def _touch(self, path: str) -> bool:
        """Mark a known object used; ``False`` when this process does not know ``path`` yet."""
        with self._lock:
            if path in self._lru:
                self._lru.move_to_end(path)
                return True
        return False

    def _adopt(self, path: str, size: int, fd: int | None = None) -> None:
        """Count an object another process wrote at a key's path, once its magic proves it ours."""
        if not _has_magic(path, fd):
            return
        with self._lock:
            if path not in self._lru:
                self._lru[path] = size
                self._used += size

    def _forget(self, path: str) -> None:
        with self._lock:
            size = self._lru.pop(path, None)
            if size is not None:
                self._used -= size

    def _reserve(self, nbytes: int) -> bool:
        """Evict least recently used objects until ``nbytes`` more fit under the capacity."""
        capacity = self.config.capacity_bytes
        if capacity is None:
            with self._lock:
                self._used += nbytes
            return True
        if nbytes > capacity:
            return False
        if self._temps and self._used + nbytes > capacity:
            self._settle_temps()
        victims: list[str] = []
        with self._lock:
            while self._used + nbytes > capacity and self._lru:
                path, size = self._lru.popitem(last=False)
                self._used -= size
                victims.append(path)
            self._used += nbytes  # reserved; corrected by _release on failure
        for path in victims:
            with contextlib.suppress(FileNotFoundError):  # another process may have removed it
                os.unlink(path)
        return True

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes counted against the capacity: known objects, in-flight writes, live temp files."""
        return self._used

    # --- I/O ----------------------------------------------------------------------------------

    def _map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``fn`` over ``items`` on the I/O threads, one contiguous chunk per thread: a future per
        item would cost more than reading a page from the page cache."""
        if self._pool is None:
            raise RuntimeError(f"file backend {self.instance!r} is not open")
        chunks = min(self.config.io_threads, len(items) // _MIN_CHUNK)
        if chunks <= 1:
            return [fn(item) for item in items]
        bounds = [len(items) * index // chunks for index in range(chunks + 1)]
        parts = [items[bounds[i] : bounds[i + 1]] for i in range(chunks)]
        futures = [self._pool.submit(_apply, fn, part) for part in parts[1:]]
        results = _apply(fn, parts[0])  # this thread works too instead of waiting idle
        for future in futures:
            results.extend(future.result())
        return results

    def exists(self, keys: Sequence[str]) -> list[bool]:
        def one(key: str) -> bool:
            path = self._path(key)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                self._forget(path)
                return False
            if not self._touch(path):
                self._adopt(path, size)
            return True

        return self._map(one, keys)

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        stored = self._map(self._put_one, objects)
        if self.config.fsync:
            self._sync_directories(objects, stored)
        return stored

    def _sync_directories(self, objects: Sequence[StorageObject], stored: list[bool]) -> None:
        """fsync mode: a rename is durable only once its directory is. One fsync per directory
        per batch; an object whose directory cannot be synced reports not stored."""
        directories = [self._path(obj.key).rpartition("/")[0] for obj in objects]
        failed = {d for d in set(directories) if not _fsync_directory(d)}
        if failed:
            for index, directory in enumerate(directories):
                if directory in failed:
                    stored[index] = False

    def _put_one(self, obj: StorageObject) -> bool:
        path = self._path(obj.key)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            pass
        else:
            if not self._touch(path):
                self._adopt(path, size)
            return True  # skip_existing: equal keys carry equal bytes
        nbytes = obj.nbytes
        if not self._reserve(nbytes):
            return False
        directory, _, name = path.rpartition("/")
        tmp = f"{directory}/.{name}{self._tmp_prefix}{next(self._tmp_serial)}"
        try:
            try:
                fd = os.open(tmp, _CREATE_FLAGS, 0o644)
            except FileNotFoundError:  # first object of this fan-out directory
                os.makedirs(directory, exist_ok=True)
                if self.config.fsync and not _fsync_directory(directory.rpartition("/")[0]):
                    raise OSError(f"cannot fsync the parent of {directory}") from None
                fd = os.open(tmp, _CREATE_FLAGS, 0o644)
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
            if path in self._lru:  # adopted meanwhile: do not count twice
                self._used -= nbytes
            else:
                self._lru[path] = nbytes
        return True

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        return self._map(self._get_one, objects)

    def _get_one(self, obj: StorageObject) -> int:
        path = self._path(obj.key)
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            self._forget(path)
            return MISS
        except OSError as exc:
            return -(exc.errno or 1)
        try:
            got = _read_all(fd, region_views(obj.regions))
            if not self._touch(path):  # written by another process after open: adopt, real size
                self._adopt(path, os.fstat(fd).st_size, fd)
        except OSError as exc:
            return -(exc.errno or 1)
        finally:
            os.close(fd)
        return got

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Unlink objects (an absent one counts as removed); frees their LRU accounting."""
        return self._map(self._remove_one, keys)

    def _remove_one(self, key: str) -> bool:
        path = self._path(key)
        self._forget(path)
        try:
            os.unlink(path)
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
