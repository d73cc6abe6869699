"""Counters of one storage engine (one backend instance) and the names of its backend calls.

Their own module so that the engine, its guarded calls (:mod:`kvstrata.core.backend_calls`) and
the cache's metrics (:mod:`kvstrata.core.metrics`) all depend on this leaf instead of on each
other: the cache attaches an engine's :class:`StorageMetrics` by type, not through callbacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum


class StorageOperation(StrEnum):
    """The backend methods the storage engine calls (as named in ``kvstrata_operation_failed``)."""

    EXISTS = "exists"
    PUT = "put"
    GET = "get"
    REMOVE = "remove"


@dataclass
class StorageMetrics:
    """Counters of one engine (one backend instance); read by metrics exporters.

    Updated under the engine's lock. ``counters()`` (the integer fields) is what the cache's
    ``snapshot()["storage"]`` and the ``kvstrata_storage_events`` Prometheus family show.
    """

    #: existence queries asked; like ``put_units`` and ``get_units`` it counts what the open
    #: breaker refused too (also in ``breaker_rejected``)
    exists_calls: int = 0
    put_units: int = 0  # units asked to store
    put_failed: int = 0  # of them, not stored (refused, failed, or the breaker open)
    put_skipped_read_only: int = 0
    get_units: int = 0
    get_hits: int = 0
    get_misses: int = 0
    corrupt_detected: int = 0  # damaged objects refused (integrity.DAMAGE verdicts)
    corrupt_reasons: dict[str, int] = field(default_factory=dict)
    corrupt_removed: int = 0  # damaged objects deleted so they are not read again
    corrupt_remove_failed: int = 0
    foreign_objects: int = 0  # intact objects of another layout / format / key (integrity.FOREIGN)
    foreign_reasons: dict[str, int] = field(default_factory=dict)
    foreign_removed: int = 0  # deleted so the key can be written again in this reader's layout
    foreign_remove_failed: int = 0
    #: objects a get rejected and then, read again at once, did not (served, or a miss): neither
    #: counted above nor removed -- the first read raced a rewrite of the object's file (the
    #: ``file`` backend recycling it for another key) or the store served bad bytes once
    reread_cleared: int = 0
    backend_errors: int = 0
    breaker_trips: int = 0  # times the circuit breaker opened
    breaker_rejected: int = 0  # calls refused at once while it was open (failed, not attempted)
    #: bytes of the objects a put reported stored: a backend keeping an object already present
    #: (``overwrite: skip_existing``: file, hf3fs, Mooncake) reports it stored, so it counts too
    bytes_written: int = 0
    bytes_read: int = 0

    def counters(self) -> dict[str, int]:
        """Every integer counter by name (the reason breakdowns are left out)."""
        return {f.name: value for f in fields(self) if isinstance(value := getattr(self, f.name), int)}

    def record_get(
        self,
        units: int,
        hits: int,
        nbytes: int,
        corrupt: Mapping[str, int],
        foreign: Mapping[str, int],
        cleared: int = 0,
    ) -> None:
        """Count one get batch (the caller holds the engine's lock)."""
        self.reread_cleared += cleared
        self.get_units += units
        self.get_hits += hits
        self.get_misses += units - hits
        self.bytes_read += nbytes
        self.corrupt_detected += sum(corrupt.values())
        self.foreign_objects += sum(foreign.values())
        for reasons, found in ((self.corrupt_reasons, corrupt), (self.foreign_reasons, foreign)):
            for reason, n in found.items():
                reasons[reason] = reasons.get(reason, 0) + n
