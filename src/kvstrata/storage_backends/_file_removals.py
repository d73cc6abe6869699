"""How processes sharing a ``file`` backend directory tell each other that objects left it.

Each process's index answers ``exists`` from memory for objects it saw within
``exists_recheck_s``; an object another process evicted (``capacity_bytes``) or removed
(damage) stayed "present" there until then -- vLLM's scheduler-side instance offered blocks its
worker-side instance had evicted, and their loads failed. So every removal appends a byte to one
file of the directory, and ``exists`` stats that file once per call: when it changed, no sighting
from before is trusted (those keys are checked on disk again).
"""

from __future__ import annotations

import os
import threading
import time

#: the note's file name (a dot name: never taken for an object, never adopted or swept)
REMOVALS_FILE = ".kvstrata-removals"
_LIMIT = 1 << 16  # truncated past this: a change of size or mtime is all a reader needs
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)

Stamp = tuple[int, int, int] | None


def _stamp(info: os.stat_result | None) -> Stamp:
    return None if info is None else (info.st_ino, info.st_size, info.st_mtime_ns)


class RemovalsNote:
    """The removals note of one directory, as one backend instance sees and writes it."""

    def __init__(self, root: str) -> None:
        self.path = f"{root}/{REMOVALS_FILE}"
        self._lock = threading.Lock()
        self._seen = _stamp(self._stat())
        self._trusted_since = float("-inf")

    def _stat(self) -> os.stat_result | None:
        try:
            return os.stat(self.path)
        except OSError:
            return None

    def trusted_since(self) -> float:
        """The monotonic time before which this instance's sightings are not trusted: when it
        noticed that another one removed objects (one ``stat``)."""
        stamp = _stamp(self._stat())
        if stamp != self._seen:
            with self._lock:
                self._seen, self._trusted_since = stamp, time.monotonic()
        return self._trusted_since

    def note(self) -> None:
        """This instance removed objects (its own index forgot them already): tell the others.
        Best effort: a directory this process may not write there is left as it is."""
        try:
            fd = os.open(self.path, _APPEND_FLAGS, 0o666)
        except OSError:
            return
        try:
            before = os.fstat(fd)
            os.write(fd, b".")
            after = os.fstat(fd)
            if after.st_size > _LIMIT:
                os.ftruncate(fd, 0)
                after = os.fstat(fd)
        except OSError:
            return
        finally:
            os.close(fd)
        with self._lock:
            # the note as this instance last saw it (or as it just created it) plus its own byte:
            # seen; else others noted removals since, which the next ``trusted_since`` must notice
            seen = self._seen == _stamp(before) or (self._seen is None and before.st_size == 0)
            if seen and after.st_size == before.st_size + 1:
                self._seen = _stamp(after)
