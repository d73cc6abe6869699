"""A circuit breaker per backend instance: stop calling a backend that keeps failing.

A backend that hangs until its deadline on every call (a stopped Mooncake master answers nothing,
so each call waits the full RPC timeout) would make every lookup and every write of the cache
that slow. After ``failures`` consecutive failed calls the breaker *opens*: calls are refused at
once, without touching the backend, so the cache keeps serving from L1/L2 at full speed. After
``cooldown_s`` one trial call goes through (*half-open*); its success closes the breaker, its
failure opens it for another cooldown.

Only whole-call failures count (the backend raised, timed out, answered nonsense): a backend that
answers quickly "not stored" for some keys (a full disk) is working, and is left alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are refused until the cooldown ends
    HALF_OPEN = "half_open"  # one trial call is in flight; the others are refused


class CircuitBreaker:
    """Thread-safe: storage worker threads and the owner thread share one per engine."""

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``failures``: consecutive failed calls that open it (0 = never opens)."""
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until: float | None = None
        self._trial = False
        #: the thread whose call is the trial: an allowed call is recorded on the thread that
        #: made it, so only that thread's outcome ends the trial
        self._trial_thread: int | None = None
        self.trips = 0  # closed -> open transitions

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._open_until is None:
                return BreakerState.CLOSED
            return BreakerState.HALF_OPEN if self._trial else BreakerState.OPEN

    def allow(self) -> bool:
        """Whether a call may go to the backend now (every allowed call must be ``record``-ed)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._trial or self._clock() < self._open_until:
                return False
            self._trial = True  # half-open: this call is the trial
            self._trial_thread = threading.get_ident()
            return True

    def refusing(self) -> bool:
        """Whether ``allow`` would refuse now, without claiming the trial call: lets a caller skip
        the work it does before a call (staging copies, checksums) that would be refused anyway."""
        with self._lock:
            if self._open_until is None:
                return False
            return self._trial or self._clock() < self._open_until

    def record(self, ok: bool) -> BreakerState | None:
        """The outcome of an allowed call (recorded on the thread that made it); returns the new
        state when this call changed it.

        A call allowed before the breaker opened may end while the trial is in flight (another
        thread's): its outcome counts, but the trial stays claimed until the trial itself ends.
        Releasing it there let a second trial through one cooldown later while the first still
        hung -- one more caller blocked on a backend that answers nothing."""
        with self._lock:
            was_open = self._open_until is not None
            if self._trial and self._trial_thread == threading.get_ident():
                self._trial = False
                self._trial_thread = None
            if ok:
                self._consecutive = 0
                self._open_until = None
                return BreakerState.CLOSED if was_open else None
            self._consecutive += 1
            if self.failures and (was_open or self._consecutive >= self.failures):
                self._open_until = self._clock() + self.cooldown_s
                if not was_open:
                    self.trips += 1
                    return BreakerState.OPEN
            return None
