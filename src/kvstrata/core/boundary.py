"""The engine boundary: what every public call checks before any state changes, and how a cache
closes.

An engine author's mistakes must cost a clear error, never another request's bytes: token ids
are checked (one rule, with or without L3) before anything is matched or locked; a lease is
honoured only by the cache that issued it (two caches per process, a target and a draft model,
are common); the cache serves one thread at a time, and a call from a second thread while one is
inside is refused, not raced. ``close`` waits a bounded time, says what it left, and never hangs
on a stuck backend. Each check is O(1) or one vectorised pass over the tokens.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import warnings
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from kvstrata.core.metrics import Operation

if TYPE_CHECKING:
    from kvstrata.core.lease import Lease

log = logging.getLogger(__name__)

#: largest token id a page key and its hash hold (ids are hashed as little-endian uint32)
MAX_TOKEN_ID = 2**32 - 1
#: how long ``close()`` waits for queued L3 writes unless told otherwise
CLOSE_TIMEOUT_S = 30.0
#: lists up to this long are checked element by element (cheaper than a tensor for a decode step)
_SMALL = 8

F = TypeVar("F", bound=Callable[..., Any])


class ConcurrentUseError(RuntimeError):
    """A cache call came from a second thread while another thread was inside a call."""


class OpenLeasesWarning(UserWarning):
    """``close()`` found leases that were never inserted or released."""


# --- token ids ------------------------------------------------------------------------------------


def token_ids(tokens: Any, what: str = "tokens") -> torch.Tensor:
    """``tokens`` as a 1-D CPU int64 tensor, or a ``TypeError`` / ``ValueError`` naming ``what``
    and what was given: one sequence (not a batch, not a scalar) of integer ids (not floats,
    not bools) in ``[0, 2**32)``. Vectorised: one max over the ids read as unsigned, never a
    per-token loop (lists of at most a few ids, a decode step, are checked directly)."""
    if (
        type(tokens) is list
        and len(tokens) <= _SMALL
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens)
    ):
        return torch.tensor(tokens, dtype=torch.int64)
    if isinstance(tokens, torch.Tensor):
        ids = tokens  # an integer tensor never requires grad
    elif isinstance(tokens, np.ndarray | array):
        ids = _from_numpy(np.asarray(tokens), what)
    elif isinstance(tokens, str | bytes | bytearray | Mapping) or not isinstance(tokens, Sequence | range):
        raise TypeError(f"{what}: expected a 1-D sequence of integer token ids, got {type(tokens).__name__}")
    elif len(tokens) == 0:
        return torch.empty(0, dtype=torch.int64)
    else:
        try:
            ids = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(
                f"{what}: expected a 1-D sequence of integer token ids in [0, 2**32), got "
                f"{type(tokens).__name__} of {len(tokens)} that is not one ({exc})"
            ) from None
    if ids.dtype is torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{what}: token ids must be integers, got {_given(tokens, ids.dtype, ids.shape)}")
    if ids.dim() != 1:
        raise ValueError(
            f"{what}: expected one sequence of token ids (1-D), got {_given(tokens, ids.dtype, ids.shape)}; "
            "a batch is one lookup per sequence"
        )
    ids = ids.to("cpu", torch.int64)  # a uint64 id past 2**63 wraps negative: refused below
    if ids.numel():
        words = ids.numpy()
        # one reduction checks both ends: a negative id is huge read as unsigned
        if int(words.view(np.uint64).max()) > MAX_TOKEN_ID:
            low = int(words.min())
            raise ValueError(
                f"{what}: token ids must lie in [0, 2**32), got {low if low < 0 else int(words.max())}"
            )
    return ids


def _from_numpy(ids: np.ndarray, what: str) -> torch.Tensor:
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{what}: token ids must be integers, got a {ids.dtype} array of shape {ids.shape}")
    return torch.from_numpy(
        ids.astype(np.int64)
    )  # a copy: the caller's (maybe read-only) array stays its own


def _given(tokens: Any, dtype: torch.dtype, shape: torch.Size) -> str:
    kind = "tensor" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
    return f"a {kind} of {dtype} with shape {tuple(shape)}"


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
    file, line, function = first._origin
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
                self.plugins.hook.kvstrata_backend_closing(instance=backend.instance, backend=backend)
                backend.close()
        except BaseException as exc:  # handed to close()'s caller when it is still waiting
            failed.append(exc)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
