"""An eviction policy's events, delivered so that a policy's bug never costs a cache operation.

A policy that hears events (``capabilities.events``) is told of matches, inserts, splits and
evictions from inside the tree's own operations, after the tree has changed: an exception
escaping there left the operation half done (an insert the tree had indexed but the request did
not record, whose units its release then freed while the tree still served them). Events are the
policy's own bookkeeping, so one that raises is logged (once per policy and event) and counted,
and the operation goes on; the policy's ranking still decides evictions.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


class GuardedEvents:
    """The events of ``order`` (the eviction policy of the ``tier`` tier, hearing them), each
    call guarded."""

    __slots__ = ("_warned", "errors", "first_error", "order", "tier")

    def __init__(self, order: Any, tier: str) -> None:
        self.order, self.tier = order, tier
        self.errors = 0  # events that raised
        self.first_error: str | None = None  # the first of them, for a conformance kit to name
        self._warned: set[str] = set()

    def _failed(self, event: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = f"{event}() raised {sys.exc_info()[1]!r}"
        if event not in self._warned:
            self._warned.add(event)
            log.warning(
                "eviction policy %s of the %s tier raised in %s(); ignored (the operation goes on; "
                "further errors of this event are counted, not logged)",
                type(self.order).__name__, self.tier, event, exc_info=True,
            )  # fmt: skip

    def _deliver(self, event: str, *args: Any) -> None:
        try:
            getattr(self.order, event)(*args)
        except Exception:
            self._failed(event)

    def accessed(self, entries: Sequence[Any]) -> None:
        self._deliver("accessed", entries)

    def inserted(self, entries: Sequence[Any]) -> None:
        self._deliver("inserted", entries)

    def split(self, upper: Any, lower: Any) -> None:
        self._deliver("split", upper, lower)

    def removed(self, entries: Sequence[Any]) -> None:
        self._deliver("removed", entries)
