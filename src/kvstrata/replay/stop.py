"""A replay's stop flag, kept apart from the driver so the command line can install its
Ctrl-C handler without importing torch (``kvstrata --version``, ``--help`` and ``config show``
never need it)."""

from __future__ import annotations

from collections.abc import Callable


class StopRequest:
    """A stop asked for from outside the loop (a signal handler sets :attr:`requested`): the
    replay ends between two requests, never inside one, then flushes its L3 writes, so the tree
    and the L3 stay consistent. While the replay runs, :attr:`pending_writes` counts the L3 write
    batches still in flight (what exiting at once would abandon)."""

    def __init__(self) -> None:
        self.requested = False
        self.pending_writes: Callable[[], int] = lambda: 0
