"""The ``file`` backend's I/O: existence, put (two-phase: temp file, ``os.replace``), get, remove,
spread over the backend's I/O threads, and the ``readv`` / ``writev`` loops under them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import stat
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstrata.plugins.storage_backend import ReadCheck, StorageObject, object_views, region_views
from kvstrata.storage_backends._file_index import _READ_FLAGS, FileIndex
from kvstrata.storage_backends._io_threads import IOThreads

#: Most platforms cap one readv/writev at 1024 iovecs (IOV_MAX).
_IOV_MAX = 1024
MISS = -1
#: Fewest objects worth handing to another I/O thread (below that, dispatch costs more than it saves).
_MIN_CHUNK = 8
#: Smallest get (bytes, estimated from its first object) whose I/O threads are held on CPUs of
#: their own (see ``_io_threads``). Holding costs about a millisecond where another thread keeps
#: a worker's CPU busy for a while: right after a multithreaded torch op (its OpenMP workers spin
#: before they sleep), a 64 x 256 KiB get read 4.3 GiB/s placed against 7.9 unplaced; from 128
#: such pages on, placed was as fast after a torch op (8.5 / 8.7) and faster after idle (8.2 /
#: 7.7; 256 pages: 10.1 / 7.7).
_PLACE_FROM_BYTES = 32 << 20
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
#: an unverified read's lock on its file: never while a put recycles it (see
#: ``FileIndex._reads_verified``); non-blocking, so a reader misses rather than waits
_SHARED = fcntl.LOCK_SH | fcntl.LOCK_NB
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_T = TypeVar("_T")
_R = TypeVar("_R")


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


class FileIO(FileIndex):
    """The I/O part of ``FileBackend`` over its index (a base class: the backend is one object)."""

    _pool: IOThreads | None
    _tmp_serial: itertools.count[int]
    _read_threads: int
    recycled_files: int

    def _map_rows(
        self, fn: Callable[[int, int], list[_R]], count: int, threads: int = 0, *, placed: bool = False
    ) -> list[_R]:
        """``fn(start, stop)`` over ``range(count)`` on the I/O threads (at most ``threads``,
        0: ``io_threads``), in pieces of consecutive rows the threads take in turn (``placed``:
        each thread on CPUs no other uses, for reads; see
        :mod:`~kvstrata.storage_backends._io_threads`): a future per item would cost more than
        reading a page from the page cache."""
        if self._pool is None:
            raise RuntimeError(f"file backend {self.instance!r} is not open")
        workers = min(threads or self.config.io_threads, count // _MIN_CHUNK)
        if workers <= 1:
            return fn(0, count)
        return self._pool.map_rows(fn, count, workers, _MIN_CHUNK, placed=placed)

    def _map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        return self._map_rows(lambda start, stop: [fn(item) for item in items[start:stop]], len(items))

    def exists(self, keys: Sequence[str], leading: bool = False) -> list[bool]:
        """From the index, without a syscall, for objects this process saw on disk within
        ``exists_recheck_s``; every other key (unknown here: possibly written by another process,
        or seen too long ago: possibly removed by one) is checked on disk.

        ``leading``: keys are checked in order on this thread and the first missing one ends the
        answer (the rest read False): a prefix query then costs the stats of its present keys
        plus one, and no worker hop, which costs more than a ``stat`` of a cached dentry."""
        recheck_s = self.config.exists_recheck_s  # 0: none from memory; see also _file_removals
        cutoff = max(time.monotonic() - recheck_s, self._removals.trusted_since() if recheck_s else 0.0)
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
            size = _object_size(f"{directory}/{name}")
        except FileNotFoundError:
            if entry is not None:
                self._forget(name, entry)  # removed by another process
            return False
        except OSError:  # e.g. a directory this process may not search: not provably there
            return False
        if entry is None:
            self._adopt(directory, name, size)
        else:
            self._seen((name,), size)
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
            size = _object_size(path)
        except FileNotFoundError:
            if entry is not None:
                self._forget(name, entry)
        except OSError:  # e.g. a directory this process may not search: this object fails alone
            return False
        else:
            if entry is None:
                self._adopt(directory, name, size)
            else:
                self._seen((name,), size)
            return True  # skip_existing: equal keys carry equal bytes
        nbytes = obj.nbytes
        fits, recycled = self._reserve(nbytes)
        if not fits:
            return False
        tmp = f"{directory}/.{name}{self._tmp_prefix}{next(self._tmp_serial)}"
        try:
            fd = self._open_temp(tmp, directory, recycled, nbytes)
            try:
                _write_all(fd, object_views(obj))
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException as exc:  # an interrupt too (the caller's thread writes a share):
            self._release(nbytes)  # no temp file nor reserved bytes left for the process's life
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not isinstance(exc, OSError):
                raise
            return False
        self._stored(directory, name, nbytes)
        return True

    def _open_temp(self, tmp: str, directory: str, recycled: str | None, nbytes: int) -> int:
        """A write descriptor on the new temp file ``tmp``: the ``recycled`` evicted file moved
        there (``_recycle``: the write covers every byte), else a file created. A file is rewritten
        only under an exclusive ``flock``, held until the caller closes the descriptor: an
        unverified reader (any process) holds a shared one, so a file it reads is unlinked
        instead, and it cannot start reading one being rewritten."""
        if recycled is not None:
            fd = self._recycle(recycled, tmp, nbytes, self._make_directory)
            if fd is not None:
                self.recycled_files += 1  # += is not atomic across threads: a statistic only
                return fd
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
        index, reading = self._index, self._reading
        # the files' names (a key, or its digest): what an eviction picks a file to recycle by
        names = [key if key in index else self._locate(key)[1] for key in (obj.key for obj in objects)]
        with self._lock:  # a file being read here is not recycled meanwhile (see _reserve)
            for name in names:
                reading[name] = reading.get(name, 0) + 1
        try:
            return self._map_rows(
                lambda start, stop: self._get_rows(objects, start, stop, check),
                len(objects),
                self._read_threads,
                placed=_batch_bytes(objects) >= _PLACE_FROM_BYTES,
            )
        finally:
            with self._lock:
                for name in names:
                    left = reading.pop(name) - 1
                    if left:
                        reading[name] = left

    def _get_rows(
        self, objects: Sequence[StorageObject], start: int, stop: int, check: ReadCheck | None
    ) -> list[int]:
        """Read objects ``start`` to ``stop`` on this thread. Kept flat: two threads reading in
        parallel share one GIL, and every Python step between the system calls is time the other
        thread may wait for. So one loop does little but the three system calls of an object the
        index holds (one ``readv`` fills every region; the file's indexed size says whether a
        second read is needed); an object not indexed under its own key goes to :meth:`_get_one`.
        Measured here: 2.5-14% less time per get than a loop of method calls over lists of paths
        and views built first."""
        index = self._index
        results: list[int] = []
        known: list[str] = []
        open_, readv, close = os.open, os.readv, os.close
        share = None if self._reads_verified else _share  # an unverified read locks its file
        for row in range(start, stop):
            obj = objects[row]
            key = obj.key
            views = obj.views  # object_views(obj), inlined: this loop runs per page
            if views is None:
                views = region_views(obj.regions)
            entry = index.get(key)  # a read of the dict is atomic: no lock
            if entry is None:  # stored under a digest, or unknown here
                got = self._get_one(obj, views, known)
            else:
                try:
                    fd = open_(f"{entry.directory}/{key}", _READ_FLAGS)
                except FileNotFoundError:
                    self._forget(key, entry)  # removed by another process
                    got = MISS
                except OSError as exc:
                    got = -(exc.errno or 1)
                else:
                    try:
                        if share is not None and not share(fd):
                            got = MISS  # being recycled: another object's bytes by now
                        else:
                            got = readv(fd, views) if len(views) <= _IOV_MAX else _read_all(fd, views)
                            if 0 < got < entry.size:  # short: another size, or the kernel stopped early
                                got += _read_all(fd, _advance(views, got))  # regions full: reads nothing
                            known.append(key)
                    except OSError as exc:
                        got = -(exc.errno or 1)
                    finally:
                        close(fd)
            if check is not None and got >= 0:
                check(row, got)
            results.append(got)
        if known:
            self._seen(known)  # one lock for the chunk, not one per object
        return results

    def _get_one(self, obj: StorageObject, views: list[memoryview], known: list[str]) -> int:
        directory, name, entry = self._lookup(obj.key)
        try:
            fd = os.open(f"{directory}/{name}", _READ_FLAGS)
        except FileNotFoundError:
            if entry is not None:
                self._forget(name, entry)
            return MISS
        except OSError as exc:
            return -(exc.errno or 1)
        try:
            if not self._reads_verified and not _share(fd):
                return MISS  # being recycled (see _get_rows)
            got = _read_all(fd, views)
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
        self._removals.note()
        return True


def _share(fd: int) -> bool:
    """Take a shared ``flock`` on a file about to be read unverified (released when it is closed):
    False while a put recycles it (an exclusive one); True where the file system has no ``flock``
    (nothing is recycled there)."""
    try:
        fcntl.flock(fd, _SHARED)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def _batch_bytes(objects: Sequence[StorageObject]) -> int:
    """A batch's bytes as its first object's times its length (a batch's pages are alike)."""
    return len(objects) * sum(region.nbytes for region in objects[0].regions) if objects else 0


def _object_size(path: str) -> int:
    """The size of the object file at ``path``. Something under an object's name that is not a
    regular file (a directory, a link to a device) holds no object: ``FileNotFoundError``, as
    for no file, so it is never offered nor taken for a stored object (audit 29: a directory
    there was offered, failed every load and was never replaced)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
    return info.st_size
