"""Repeated warnings collapsed into counts, so an outage reads as a few lines and a summary.

An L3 outage makes every storage call fail the same way: before the circuit breaker, one Mooncake
outage printed 7,246 warning lines, and the few lines that mattered were lost among them. Here a
line is *like* another when it comes from the same place: the same logging call (logger, file,
line) for Python warnings, the same ``severity file:line]`` prefix for native glog lines (Mooncake's
C++ client writes straight to file descriptor 2). Per place and per interval the first ``burst``
lines are printed; the rest are counted, and the next line printed from that place says
``(N more like this in the last T s)``. At the end a summary names what was held back.

Two parts, one policy (:class:`RepeatLimiter`):

- :class:`RepeatFilter`, a ``logging.Filter`` for Python warnings (on a handler);
- :func:`native_line_limiter`, which points file descriptor 2 at a pipe read by a small child
  process running this file as a script. A child, not a thread: when this process dies (a native
  crash, ``kill -9``) the child still reads what was written before and passes it on. Python's own
  ``sys.stderr`` keeps writing to the original stream directly (a terminal stays a terminal).

This file imports only the standard library: the child runs it as a plain script.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, BinaryIO

#: Environment switch: seconds per interval (0 turns the limiting off).
INTERVAL_ENV = "KVSTRATA_REPEAT_INTERVAL_S"
DEFAULT_INTERVAL_S = 10.0
#: Lines printed per place and interval before the rest are counted.
DEFAULT_BURST = 3
#: Places the end-of-run summary names (the others are counted in its first line).
SUMMARY_PLACES = 5

#: A glog line: severity letter, date, time, thread id, ``file:line]``.
_GLOG = re.compile(rb"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]\s]+)\]")
#: What glog prints once before its INFO lines when the library did not initialise it.
_GLOG_PREAMBLE = b"WARNING: Logging before InitGoogleLogging() is written to STDERR"
#: Environment switch: ``1`` shows native INFO lines (Mooncake's set-up chatter, ~15 per run).
NATIVE_INFO_ENV = "KVSTRATA_NATIVE_INFO"


def interval_from_env(default: float = DEFAULT_INTERVAL_S) -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, default)))
    except ValueError:
        return default


@dataclass
class _Place:
    window_start: float
    printed: int = 0  # in the current window
    held: int = 0  # held back since the last printed line
    total_held: int = 0
    example: str = ""


@dataclass
class RepeatLimiter:
    """Per place: at most ``burst`` lines per ``interval_s``; the rest are counted. Thread-safe
    enough for its users (the GIL; a lost count under a race is harmless)."""

    interval_s: float = DEFAULT_INTERVAL_S
    burst: int = DEFAULT_BURST
    clock: Callable[[], float] = time.monotonic
    places: dict[Hashable, _Place] = field(default_factory=dict)

    def admit(self, place: Hashable, text: str) -> tuple[bool, int, float]:
        """(print it?, lines held back from this place since its last printed line, over how
        many seconds). Only a printed line reports the held count, and resets it."""
        now = self.clock()
        state = self.places.get(place)
        if state is None:
            self.places[place] = _Place(window_start=now, printed=1, example=text)
            return True, 0, 0.0
        if self.interval_s <= 0:
            return True, 0, 0.0
        if now - state.window_start >= self.interval_s:
            held, span = state.held, now - state.window_start
            state.window_start, state.printed, state.held = now, 1, 0
            return True, held, span
        if state.printed < self.burst:
            state.printed += 1
            return True, 0, 0.0
        state.held += 1
        state.total_held += 1
        return False, 0, 0.0

    def summary(self) -> list[str]:
        """Lines naming what was held back, most frequent first (empty when nothing was)."""
        held = sorted(((p.total_held, p.example) for p in self.places.values() if p.total_held), reverse=True)
        if not held:
            return []
        total = sum(count for count, _ in held)
        places = f"{len(held)} place" + ("s" if len(held) > 1 else "")
        lines = [f"{total:,} repeated line{'s' if total > 1 else ''} held back from {places}; most frequent:"]
        for count, example in held[:SUMMARY_PLACES]:
            lines.append(f"  {count:,} more like: {example[:200]}")
        return lines


def note(held: int, span_s: float) -> str:
    return f" ({held:,} more like this in the last {span_s:.0f} s)"


class RepeatFilter(logging.Filter):
    """Collapses repeated warnings (and errors) of one logging call into counts; lower levels pass."""

    def __init__(self, limiter: RepeatLimiter) -> None:
        super().__init__()
        self.limiter = limiter

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        place = (record.name, record.pathname, record.lineno, record.levelno)
        printed, held, span = self.limiter.admit(place, record.getMessage())
        if printed and held:
            record.msg, record.args = record.getMessage() + note(held, span), None
        return printed


@contextmanager
def repeated_warnings_limited(
    stream: IO[str], logger_name: str = "kvstrata", limiter: RepeatLimiter | None = None
) -> Iterator[RepeatLimiter]:
    """Print ``logger_name``'s warnings to ``stream`` as ``warning: ...`` lines, repeats
    collapsed; yields the limiter (its :meth:`RepeatLimiter.summary` ends the run). Records
    still propagate to the root logger's handlers, if an application configured any."""
    limiter = limiter or RepeatLimiter(interval_s=interval_from_env())
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_LevelPrefix())
    handler.addFilter(RepeatFilter(limiter))
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield limiter
    finally:
        logger.removeHandler(handler)


class _LevelPrefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {super().format(record)}"


# --- native lines (file descriptor 2) -------------------------------------------------------------


@contextmanager
def native_line_limiter(interval_s: float | None = None, burst: int = DEFAULT_BURST) -> Iterator[None]:
    """Route what native code writes to file descriptor 2 through a child process that collapses
    repeated glog lines (other lines pass unchanged); ``sys.stderr`` keeps the original stream.
    The child prints its summary when the block ends (or when this process dies)."""
    interval = interval_from_env() if interval_s is None else interval_s
    if interval <= 0 or not _stderr_is_fd_2():  # e.g. a test runner capturing sys.stderr itself
        yield
        return
    sys.stderr.flush()
    original = os.dup(2)
    info = "info" if os.environ.get(NATIVE_INFO_ENV, "") not in ("", "0") else "noinfo"
    child = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), str(interval), str(burst), info],
        stdin=subprocess.PIPE,
        stdout=original,
        stderr=original,
        # its own process group: a Ctrl-C at the terminal is the parent's to handle, and one
        # arriving while the child's interpreter starts (before it can ignore SIGINT) killed it
        # with a "Fatal Python error" traceback on the user's screen
        process_group=0,
    )
    assert child.stdin is not None
    saved_stderr = sys.stderr
    python_stderr = os.fdopen(
        os.dup(original), "w", buffering=1, encoding=saved_stderr.encoding, errors="backslashreplace"
    )
    os.dup2(child.stdin.fileno(), 2)
    sys.stderr = python_stderr
    try:
        yield
    finally:
        python_stderr.flush()
        os.dup2(original, 2)  # fd 2 is the original stream again: the pipe's last writer is ours
        sys.stderr = saved_stderr
        python_stderr.close()
        child.stdin.close()  # EOF: the child prints its summary and exits
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        os.close(original)


def _stderr_is_fd_2() -> bool:
    try:
        return sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return False


def pump(source: BinaryIO, sink: BinaryIO, limiter: RepeatLimiter, show_info: bool = True) -> None:
    """Copy lines from ``source`` to ``sink``, collapsing repeated glog lines; summary at EOF.
    ``show_info=False`` holds back glog INFO lines (counted in the summary): warnings and errors
    are what a user acts on."""
    hidden = 0
    for line in iter(source.readline, b""):
        match = _GLOG.match(line)
        if not show_info and (
            line.startswith(_GLOG_PREAMBLE) or (match is not None and match.group(1) == b"I")
        ):
            hidden += 1
            continue
        if match is None:  # not a native log line: ours or unknown, passed unchanged
            sink.write(line)
            sink.flush()
            continue
        text = line.decode("utf-8", "backslashreplace").rstrip("\n")
        printed, held, span = limiter.admit(match.group(1, 2), text)
        if printed:
            sink.write((text + (note(held, span) if held else "") + "\n").encode())
            sink.flush()
    for text in limiter.summary():
        sink.write(f"native log: {text}\n".encode())
    if hidden:
        sink.write(f"native log: {hidden:,} info lines not shown ({NATIVE_INFO_ENV}=1 shows them)\n".encode())
    sink.flush()


if __name__ == "__main__":  # the child of native_line_limiter
    import signal

    # started in a process group of its own; should a SIGINT still reach it, it ends at EOF,
    # when its parent is done
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    show = len(sys.argv) < 4 or sys.argv[3] == "info"
    pump(sys.stdin.buffer, sys.stdout.buffer, RepeatLimiter(float(sys.argv[1]), int(sys.argv[2])), show)
