"""The engine boundary: what every public call checks before any state changes, and how a cache
closes.

An engine author's mistakes must cost a clear error, never another request's bytes: token ids
are checked (one rule, with or without L3: :mod:`~kvstrata.core.tokens`) before anything is
matched or locked; a lease is honoured only by the cache that issued it (two caches per process,
a target and a draft model, are common); the cache serves one thread at a time, and a call from
a second thread while one is inside is refused, not raced. ``close`` waits a bounded time, says
what it left, and never hangs on a stuck backend. Each check is O(1) or one vectorised pass over
the tokens.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from kvstrata.core.metrics import Operation
from kvstrata.core.tokens import token_ids as token_ids  # where adapters have imported it from

if TYPE_CHECKING:
    from kvstrata.core.lease import Lease

log = logging.getLogger(__name__)

#: how long ``close()`` waits for queued L3 writes unless told otherwise
CLOSE_TIMEOUT_S = 30.0

F = TypeVar("F", bound=Callable[..., Any])


class ConcurrentUseError(RuntimeError):
    """A cache call came from a second thread while another thread was inside a call."""


class OpenLeasesWarning(UserWarning):
    """``close()`` found leases that were never inserted or released."""


# --- one thread at a time ------------------------------------------------------------------------


def exclusive(method: F) -> F:
    """Refuse a call while another thread is inside a call of the same cache (``_guard``, an
    ``RLock``: a call may make nested calls on its own thread). A non-blocking acquire costs
    about what a dict lookup does; an engine that calls from several threads under its own lock
    never sees the error."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = self._guard
        if not guard.acquire(False):
            raise ConcurrentUseError(
                f"cache.{name}() called from thread {threading.current_thread().name!r} while another "
                f"thread is inside cache.{self._inside}(): a cache serves one thread at a time "
                "(call it from the scheduler thread, or hold one lock around every call)"
            )
        outer, self._inside = self._inside, name
        try:
            return method(self, *args, **kwargs)
        finally:
            self._inside = outer
            guard.release()

    return call  # type: ignore[return-value]


# --- where a lease came from ---------------------------------------------------------------------


def caller_origin(depth: int = 2) -> tuple[str, int, str]:
    """(file, line, function) of the code that called the public method ``depth`` frames up:
    three attribute reads, formatted only when a warning needs it."""
    frame = sys._getframe(depth)
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def warn_open_leases(leases: Mapping[int, Lease]) -> None:
    """One warning at ``close()`` for the leases never inserted or released: how many, and
    where the first was taken (their units stay in use while the process lives)."""
    if not leases:
        return
    first = next(iter(leases.values()))
    file, line, function = first.origin
    warnings.warn(
        OpenLeasesWarning(
            f"cache closed with {len(leases)} open lease(s) (never inserted or released); the first "
            f"was taken by lookup at {file}:{line} in {function}() for {len(first.keys)} page(s): "
            "release every lease you do not insert"
        ),
        stacklevel=3,
    )


# --- close ---------------------------------------------------------------------------------------


class ClosingApi:
    """``close`` and the context manager of :class:`~kvstrata.core.controller.CacheController`
    (a mixin, so the controller stays a coordinator)."""

    _closed: bool
    _leases: dict[int, Lease]
    parts: Any
    plugins: Any
    writer: Any
    prefetcher: Any
    metrics: Any

    def flush(self, timeout: float | None = None) -> None:  # provided by the controller
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("cache is closed")

    @property
    def open_leases(self) -> int:
        """Leases looked up and neither inserted nor released (their units are in use)."""
        return len(self._leases)

    @exclusive
    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Wait up to ``timeout`` seconds (``None``: as long as it takes) for queued L3 writes,
        as ``flush(timeout=)`` does, then stop the storage threads and close the backend. Writes
        still unfinished then are cancelled and counted (``operations.storage_writes_abandoned``);
        a backend call still running is left to end on its own thread, and the backend is
        closed after it returns. Warns once about leases never inserted or released."""
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        warn_open_leases(self._leases)
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            self._shut_down(deadline)

    def _shut_down(self, deadline: float | None) -> None:
        unfinished = sum(not write.future.done() for write in self.writer.pending)
        if unfinished:
            self.metrics.count(Operation.STORAGE_WRITES_ABANDONED, unfinished)
            log.warning("cache closed with %d L3 write(s) unfinished: cancelled, not stored", unfinished)
        # queued work is cancelled now; what a worker is running ends on its own
        self.writer.shutdown(wait=False)
        if self.prefetcher is not None:
            self.prefetcher.shutdown(wait=False)
        failed: list[BaseException] = []
        closer = threading.Thread(
            target=self._close_storage, args=(failed,), name="kvstrata-close", daemon=True
        )
        closer.start()
        closer.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if closer.is_alive():
            log.warning("a backend call is still running: the backend closes when it returns")
        elif failed:
            raise failed[0]

    def _close_storage(self, failed: list[BaseException]) -> None:
        """Join the storage threads, then close the backend (on its own thread: a stuck
        backend call must not hold ``close``)."""
        try:
            self.writer.shutdown(wait=True)
            if self.prefetcher is not None:
                self.prefetcher.shutdown(wait=True)
            backend = self.parts.backend
            if backend is not None:
                try:  # (an observer's BaseException must not keep the backend open)
                    self.plugins.notify(
                        "kvstrata_backend_closing", instance=backend.instance, backend=backend
                    )
                finally:
                    backend.close()
        except BaseException as exc:  # handed to close()'s caller when it is still waiting
            failed.append(exc)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
