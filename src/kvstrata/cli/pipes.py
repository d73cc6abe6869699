"""A reader that stops reading (``kvstrata plugins --json | head -1``, ``| grep -q``) is no error.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises ``BrokenPipeError``:
click turned it into exit 1, and the interpreter's last flush printed "Exception ignored ...
BrokenPipeError" (exit 120), or nothing at all went wrong when the output fit in the pipe before
the reader left. The exit code depended on timing, and a ``replay`` whose summary was cut off
exited 1 where it served corrupt data (3). Instead the CLI's streams drop what the reader no
longer takes: the first broken write points the file descriptor at ``/dev/null`` (as Python's
documentation of SIGPIPE advises), nothing is printed about it, and the command goes on to exit
with its own code, the same however fast the reader left.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, TextIO


class ReaderGoneQuiet:
    """``sys.stdout`` / ``sys.stderr`` for the CLI: writes and flushes that find the pipe's
    reader gone are dropped quietly (see the module docstring); everything else is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._discard()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self) -> None:
        """Point the stream's descriptor at ``/dev/null``: what is still buffered, and whatever
        the command writes later (its last flush at exit included), goes nowhere, without error."""
        with suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer...
        return getattr(self._stream, name)


@contextmanager
def reader_gone_quiet() -> Iterator[None]:
    """Wrap ``sys.stdout`` and ``sys.stderr`` for the block (``main()``), flush them at its end
    (the data a gone reader left buffered is dropped there, not at the interpreter's exit with an
    "Exception ignored" message), and restore the streams as they were."""
    saved = sys.stdout, sys.stderr
    wrapped = ReaderGoneQuiet(saved[0]), ReaderGoneQuiet(saved[1])
    sys.stdout, sys.stderr = wrapped  # type: ignore[assignment]
    try:
        yield
    finally:
        for stream in wrapped:
            with suppress(OSError, ValueError):  # ValueError: a stream closed meanwhile
                stream.flush()
        sys.stdout, sys.stderr = saved
