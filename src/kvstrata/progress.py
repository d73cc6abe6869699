"""Progress of long CLI runs: a live bar on a terminal, plain periodic lines when piped.

A replay of a full trace takes minutes; run under ``nohup``, CI or ``| tee`` the live bar is off,
and without these lines nobody could tell a slow run from a stuck one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

#: Seconds between plain progress lines when the output is not a terminal (environment switch).
INTERVAL_ENV = "KVSTRATA_PROGRESS_S"
DEFAULT_INTERVAL_S = 10.0

ProgressFn = Callable[[int, int], None]


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


def eta_text(done: int, total: int, elapsed_s: float) -> str:
    """``ETA 1m05s`` from the mean rate so far (``ETA ?`` before the first item)."""
    if done <= 0 or elapsed_s <= 0:
        return "ETA ?"
    remaining = round((total - done) * elapsed_s / done)
    minutes, seconds = divmod(remaining, 60)
    return f"ETA {minutes}m{seconds:02d}s" if minutes else f"ETA {seconds}s"


@contextmanager
def progress(console: Console, verb: str, total: int, *, quiet: bool = False) -> Iterator[ProgressFn]:
    """Yield ``update(done, total)``: a live bar with ETA on a terminal; otherwise a plain line
    every ``$KVSTRATA_PROGRESS_S`` seconds (10 by default) and one when the run is complete."""
    if quiet:
        yield lambda _done, _total: None
        return
    if console.is_terminal:
        with Progress(
            TextColumn(verb),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task(verb, total=total)
            yield lambda done, _total: bar.update(task, completed=done)
        return
    interval = _interval()
    started = last = time.monotonic()
    ended = False  # the completion line is printed (a caller may report the end twice)

    def update(done: int, of: int) -> None:
        nonlocal last, ended
        now = time.monotonic()
        if ended or (done < of and now - last < interval):
            return
        last, ended = now, done >= of
        elapsed = now - started
        share = done / of if of else 1.0
        tail = (
            f"in {elapsed:.1f} s" if done >= of else f"{elapsed:.1f} s elapsed, {eta_text(done, of, elapsed)}"
        )
        console.print(f"{verb} {done:,}/{of:,} requests ({share:.0%}), {tail}", highlight=False, markup=False)

    yield update
