"""Ctrl-C during ``kvstrata replay``: the report of what was replayed, one line saying what was
kept, exit 130, never a traceback.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be (a logging filter, a torch
call, the middle of an insert) prints a traceback and leaves the run's state unknown. Instead a
SIGINT handler only sets a flag while the replay runs: the driver stops between two requests,
flushes its L3 writes and returns, and the command reports the requests replayed so far (the
summary, ``--json``, ``--plot``), prints one line and exits 130. A second
Ctrl-C exits at once, saying how many L3 write batches it abandons (objects are written to a
temporary name and renamed, so an abandoned write leaves no half object behind), and removes the
run's temporary L3 directory first (the exit skips every ``finally``); SIGTERM (``timeout``, a
cancelled CI job) exits at once the same way, with 143. Before the
replay starts (config, trace, reference simulation) nothing has been written: a Ctrl-C there
exits 130 at once.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType

from kvstrata.replay.stop import StopRequest

#: The exit status of a process ended by SIGINT, as shells report it (128 + 2).
EXIT_INTERRUPTED = 130


class ReplayInterrupt(StopRequest):
    """The replay's stop flag, set by the SIGINT handler (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.running = False  # True once the cache is open and requests are being replayed
        #: the run's temporary L3 directory: the exit at once skips the command's ``finally``
        #: that removes it, so the handler removes it itself (it may hold hundreds of MB)
        self.scratch: Path | None = None

    def handle(self, _signum: int, _frame: FrameType | None) -> None:
        if not self.running:
            _say("interrupted before the replay started; nothing was written")
            raise SystemExit(EXIT_INTERRUPTED)  # not an Exception: no handler on the way swallows it
        if self.requested:  # the second Ctrl-C: leave now
            abandoned = self.pending_writes()
            _say(
                f"interrupted again: exiting at once; L3 write batches abandoned: {abandoned} "
                "(an unfinished object is never visible: it is a miss, not data)" + self._remove_scratch()
            )
            os._exit(EXIT_INTERRUPTED)
        self.requested = True
        _say("interrupt: finishing the current request and flushing L3 writes (Ctrl-C again exits at once)")

    def terminate(self, signum: int, _frame: FrameType | None) -> None:
        """SIGTERM (``timeout``, a cancelled CI job): exit at once, as the default action does,
        but first remove the temporary L3 directory, which that action leaves behind."""
        code = 128 + signum
        if not self.running:  # nothing written yet: the command's ``finally`` removes it
            _say("terminated before the replay started; nothing was written")
            raise SystemExit(code)
        abandoned = self.pending_writes()
        _say(f"terminated: exiting at once; L3 write batches abandoned: {abandoned}" + self._remove_scratch())
        os._exit(code)

    def _remove_scratch(self) -> str:
        """Remove the temporary L3 directory; what the exit line adds about it ("" when none).
        A write still in flight may recreate a sub-directory: removal is retried, and a
        directory that still exists is named so the user can remove it."""
        if self.scratch is None:
            return ""
        for _ in range(3):
            shutil.rmtree(self.scratch, ignore_errors=True)
            if not self.scratch.exists():
                return "; temporary L3 directory removed"
        return f"; temporary L3 directory left behind: {self.scratch} (remove it)"


def exit_on_interrupt(_signum: int, _frame: FrameType | None) -> None:
    """Every command but ``replay``: nothing to finish or flush, so one line and exit 130."""
    _say("interrupted")
    raise SystemExit(EXIT_INTERRUPTED)


def _say(line: str) -> None:
    """One line straight to the error stream's file descriptor: the handler may have interrupted
    a write on that very stream, and a buffered write from here would be a reentrant call."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        fd = 2
    with suppress(OSError):
        os.write(fd, f"\n{line}\n".encode())


@contextmanager
def sigint_handled() -> Iterator[ReplayInterrupt]:
    """Install the replay's SIGINT and SIGTERM handlers for the block (main thread only;
    elsewhere, e.g. a test calling the app from a worker thread, the default behaviour stays)."""
    interrupt = ReplayInterrupt()
    try:
        previous = signal.signal(signal.SIGINT, interrupt.handle)
    except ValueError:  # not the main thread
        yield interrupt
        return
    previous_term = signal.signal(signal.SIGTERM, interrupt.terminate)
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)


@contextmanager
def writing_output(option: str, path: Path) -> Iterator[None]:
    """While the command writes ``path`` (its ``--plot`` / ``--sweep`` file): a SIGTERM or a
    Ctrl-C ends it with one line and exit 143 / 130 by raising ``SystemExit``, so every
    ``finally`` runs on the way out: the writer's removes its temporary file (SIGTERM's default
    action, and ``replay``'s exit at once, left a hidden ``.NAME.PID.partial`` beside the plot)
    and ``replay``'s removes its temporary L3 directory. Main thread only; the handlers before
    are restored after the block."""

    def stop(signum: int, _frame: FrameType | None) -> None:
        what = "terminated" if signum == signal.SIGTERM else "interrupted"
        _say(f"{what} while writing {option} {path}: stopped, no partial file left")
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        yield
        return
    previous_int = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
