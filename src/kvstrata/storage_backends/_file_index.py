"""The ``file`` backend's index: which objects of its directory this process knows, where they
live, how many bytes they count against the capacity, and the LRU eviction that keeps it.

Also what makes a file provably the backend's own (its layout, its magic; see ``file.py``):
adoption at open and on first touch, and other writers' temp files.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstrata.plugins.storage_backend import OBJECT_MAGIC
from kvstrata.storage_backends._file_config import FileConfig
from kvstrata.storage_backends._file_recycle import move_for_rewrite
from kvstrata.storage_backends._file_removals import RemovalsNote

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_TMP_MARK = ".tmp-"
#: A temp file of this backend: ``.{object name}.tmp-{pid}-{host tag}{random}-{serial}``, tag and
#: random 8 hex digits each. Earlier releases wrote 4 each: such names are still other writers'
#: temp files, whose 4-digit tag never matches this host's (only their age makes them stale).
_TMP_NAME = re.compile(
    r"^\.(?P<name>[A-Za-z0-9_.-]{1,200})\.tmp-(?P<pid>\d+)-(?P<token>[0-9a-f]{16}|[0-9a-f]{8})-\d+$"
)
_DIGEST_NAME = re.compile(r"^[0-9a-f]{32}$")
_HEX = frozenset("0123456789abcdef")
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)  # no O_NOATIME: atime seeds the LRU
log = logging.getLogger("kvstrata.storage_backends.file")


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


class _Entry:
    """What the index knows of one object: its directory, its size, and when (monotonic clock)
    this process last saw it on disk (opened, wrote, stat-ed, or found at open)."""

    __slots__ = ("directory", "seen", "size")

    def __init__(self, directory: str, size: int, seen: float) -> None:
        self.directory = directory
        self.size = size
        self.seen = seen


class FileIndex:
    """The index part of ``FileBackend`` (a base class: the backend is one object)."""

    instance: str
    config: FileConfig

    def _init_index(self, root: Path) -> None:
        """The index's state, empty until ``_adopt_existing`` runs at open."""
        self.root = root
        # Paths are plain strings on the data path: pathlib costs more than the syscalls it wraps.
        self._root = os.fspath(root)
        #: The index: object file name (the key, or its digest) -> entry, least recently used first.
        #: ``exists`` answers from it without a syscall; it is also the LRU of the capacity.
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._temps: dict[str, int] = {}  # other writers' live temp files: path -> bytes counted
        self._written = False  # whether this instance ever put: only a writer evicts
        self._used = 0
        self._lock = threading.Lock()
        self._host = _host_tag()  # in each temp name: says whose pids this host can check
        self._tmp_prefix = f"{_TMP_MARK}{os.getpid()}-{self._host}{uuid.uuid4().hex[:8]}-"
        #: Abandoned temp files (of writers that died) removed at open or under capacity pressure.
        self.stale_temps_removed = 0
        #: Evicted objects whose file could not be removed (they stay on disk, out of the index).
        self.unlink_failures = 0
        #: Object file names (a key, or its digest) being read by this process: never recycled
        #: while a read may be under way.
        self._reading: dict[str, int] = {}
        #: Whether every read of this instance is checksum-verified (the core says so through
        #: ``set_read_verification``): the condition for recycling evicted files. A reader that
        #: opened a file before it was recycled may read a mix of two objects: a verified read
        #: turns that into a miss; an unverified one (``checksum: none``, in any process sharing
        #: the directory) holds a shared ``flock`` while it reads, and a file is recycled only
        #: under an exclusive one (see ``_open_temp``), so it reads one whole object or misses.
        self._reads_verified = False
        #: other processes' removals: what this instance's sightings are trusted since
        self._removals = RemovalsNote(self._root)

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
        except OSError as exc:  # the backend's own directory: nothing works without it
            raise OSError(exc.errno, f"cannot list {self._root}: {exc.strerror or exc}") from exc
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
            except OSError as exc:  # e.g. another user's private fan-out directory: not ours to count
                log.warning("file backend %r: skipping %s at open: %s", self.instance, directory, exc)
                continue
            directory = sys.intern(directory)  # one string per directory, shared by its entries
            for entry in entries:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    info = entry.stat(follow_symlinks=False)
                except OSError:  # removed meanwhile, or not ours to read
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
        """Another writer's temp file: removed when stale (older than ``stale_temp_s``, or its
        writer was a process of this host that is gone), else counted. Counted whatever its pid
        said, a burst of crashes left a restarted process evicting nearly everything on each put
        for ``stale_temp_s`` (10 minutes)."""
        if age_s > self.config.stale_temp_s or _writer_gone(path.rpartition("/")[2], self._host):
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

    # --- paths ------------------------------------------------------------------------------

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

    def _seen(self, names: Sequence[str], size: int = -1) -> None:
        """Objects just proven on disk (read, written, stat-ed): most recently used, seen now. A
        stat's ``size`` (of the one name) replaces the length counted: another process may have
        replaced the object by one of another length (the capacity drifted by the difference)."""
        now = time.monotonic()
        index = self._index
        with self._lock:
            for name in names:
                entry = index.get(name)
                if entry is not None:
                    entry.seen = now
                    index.move_to_end(name)
                    if size >= 0:
                        self._used += size - entry.size
                        entry.size = size

    def _adopt(self, directory: str, name: str, size: int, fd: int | None = None) -> None:
        """Index an object another process wrote at a key's path, once its magic proves it ours."""
        if not _has_magic(f"{directory}/{name}", fd):
            return
        capacity = self.config.capacity_bytes
        with self._lock:
            if name not in self._index:
                self._index[name] = _Entry(directory, size, time.monotonic())
                self._used += size
            # an instance that never writes never evicts: past the capacity it forgets its least
            # recently used entries (their files stay), or its index grew with every object it
            # ever found (vLLM's scheduler side: ~290 bytes per block, while the directory stayed
            # at capacity); a writer trims by evicting at its next put
            while (
                not self._written and capacity is not None and self._used > capacity and len(self._index) > 1
            ):
                self._used -= self._index.popitem(last=False)[1].size

    def _forget(self, name: str, seen: _Entry | None = None) -> None:
        """Drop ``name`` from the index; with ``seen`` (the entry a read found missing on disk),
        only while the index still holds that entry: a put of the key on another thread may have
        stored it again meanwhile, and dropping that new entry left its file uncounted, never
        evicted (the directory grew past ``capacity_bytes``)."""
        with self._lock:
            entry = self._index.get(name)
            if entry is not None and (seen is None or entry is seen):
                del self._index[name]
                self._used -= entry.size

    def _stored(self, directory: str, name: str, nbytes: int) -> None:
        """A put renamed its object into place: index it (the bytes were reserved already)."""
        with self._lock:
            known = self._index.get(name)
            if known is not None:  # adopted meanwhile: do not count twice
                self._used -= nbytes
                known.seen = time.monotonic()
            else:
                self._index[name] = _Entry(directory, nbytes, time.monotonic())

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
        self._written = True
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
            self._unlink_victim(path)
        if victims:  # a recycled file leaves its name later (``_recycle``), and notes it then
            self._removals.note()
        return True, recycled

    def _unlink_victim(self, path: str) -> None:
        """Remove an evicted object's file. It has left the index (this process no longer counts
        or serves it) whatever happens here: one another process removed first is gone already;
        one that cannot be removed (another user's file in a shared directory, a read-only file
        system) stays on disk, said once per failure, and never fails the put that evicted it."""
        try:
            os.unlink(path)
        except FileNotFoundError:  # another process removed it
            return
        except OSError as exc:
            with self._lock:
                self.unlink_failures += 1
            log.warning("file backend %r: cannot remove evicted object %s: %s", self.instance, path, exc)

    def _recycle(self, path: str, tmp: str, nbytes: int, make_directory: Callable[[str], None]) -> int | None:
        """``move_for_rewrite`` of the evicted file ``path``, unless a read here chose it after the
        eviction (then it is unlinked); either way its object has left its name: noted now."""
        with self._lock:
            reading = path.rpartition("/")[2] in self._reading
        if reading:
            fd = None
            with contextlib.suppress(OSError):
                os.unlink(path)
        else:
            fd = move_for_rewrite(path, tmp, nbytes, make_directory)
        self._removals.note()
        return fd

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes counted against the capacity: known objects, in-flight writes, live temp files."""
        return self._used

    # --- I/O ----------------------------------------------------------------------------------


def _pid_namespace() -> str:
    """This process's PID namespace (Linux: ``pid:[inode]``; "" where it cannot be read)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _host_tag(hostname: str | None = None, pid_namespace: str | None = None) -> str:
    """8 hex digits of this host's name and PID namespace in each temp file's name: a writer's
    pid says whether it is alive only where its pids are (containers with the host's network
    share its name, not its pids: a pod's live writer looked dead to another pod). 32 bits: with
    4 digits, two of ~150 hosts sharing a directory likely had one tag (``node-106`` and
    ``node-154`` do), and each took the other's live writers for its own dead ones at open,
    deleting their temp files under them (those puts failed)."""
    host = socket.gethostname() if hostname is None else hostname
    namespace = _pid_namespace() if pid_namespace is None else pid_namespace
    return hashlib.blake2b(f"{host}\x00{namespace}".encode(), digest_size=4).hexdigest()


def _writer_gone(temp_name: str, host: str) -> bool:
    """Whether the temp file ``temp_name`` is a dead writer's: one of this host's pids that no
    process has now (another user's live process answers ``PermissionError``: alive)."""
    match = _TMP_NAME.match(temp_name)
    if (
        match is None
        or match["token"][: len(match["token"]) // 2] != host
        or int(match["pid"]) == os.getpid()
    ):
        return False
    try:
        os.kill(int(match["pid"]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
