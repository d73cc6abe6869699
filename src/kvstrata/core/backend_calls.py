"""Every backend call of a :class:`~kvstrata.core.storage_engine.StorageEngine` goes through here.

One place decides what a call may cost the caller: a raise or a wrong-length answer fails that
call only (counted, logged, reported to the ``kvstrata_operation_failed`` hook), and the circuit
breaker refuses calls at once while a backend keeps failing -- before any per-byte work when the
caller asks ``breaker.refusing()`` first. Reads (``exists``, ``get``) and writes (``put``,
``remove``) have a breaker each: a store whose writes fail while its reads still answer (a full or
read-only medium raising, a transfer path down while the metadata service answers) stops being
written to without losing the reads, and the reads' successes do not keep resetting the writes'
count.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvstrata.core.breaker import BreakerState, CircuitBreaker
from kvstrata.core.integrity import FOREIGN, Verdict
from kvstrata.core.storage_batch import BatchResult
from kvstrata.core.storage_metrics import StorageMetrics, StorageOperation

if TYPE_CHECKING:
    from kvstrata.plugins.storage_backend import StorageBackend

log = logging.getLogger("kvstrata.core.storage_engine")

#: the operations the write breaker guards (the others: the read breaker)
_WRITES = frozenset({StorageOperation.PUT, StorageOperation.REMOVE})

#: an event hook's call by name, which never raises (``PluginHost.notify``)
Notify = Callable[..., None]


class BackendCalls:
    """Guarded calls and their counters; the engine sets these attributes in its ``__init__``."""

    backend: StorageBackend
    metrics: StorageMetrics
    read_breaker: CircuitBreaker
    write_breaker: CircuitBreaker
    _lock: threading.Lock
    _notify: Notify | None
    _removable: bool  # the backend declares ``removable``
    keep_foreign: bool

    def breaker(self, operation: StorageOperation) -> CircuitBreaker:
        """The breaker guarding ``operation``: the write breaker for puts and removes, the read
        breaker for existence queries and gets."""
        return self.write_breaker if operation in _WRITES else self.read_breaker

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.metrics, name, getattr(self.metrics, name) + delta)

    def _emit(self, name: str, **kwargs: Any) -> None:
        """Call a per-batch event hook (``PluginHost.notify`` guards it: an observer's failure
        never fails the operation)."""
        if self._notify is not None:
            self._notify(name, **kwargs)

    def _backend_failed(self, operation: StorageOperation, pool: str, exc: BaseException) -> str:
        self._count(backend_errors=1)
        message = f"{operation} on backend {self.backend.instance!r} (pool {pool!r}) failed: {exc!r}"
        log.warning(message)
        self._emit(
            "kvstrata_operation_failed", operation=operation, instance=self.backend.instance, error=exc
        )
        return message

    def _call_backend(
        self, operation: StorageOperation, pool: str, items: Sequence[Any], **options: Any
    ) -> tuple[list[Any] | None, str | None]:
        """Run ``backend.<operation>(items)``; a raise or a wrong-length answer fails the whole
        call (``None`` and why), never the caller. While the circuit breaker is open the backend
        is not called at all: the call fails at once."""
        breaker = self.breaker(operation)
        if not breaker.allow():
            return None, self._refused(operation)
        try:
            answer = list(getattr(self.backend, operation)(items, **options))
            if len(answer) != len(items):
                raise RuntimeError(f"backend returned {len(answer)} results for {len(items)} items")
            if operation == StorageOperation.GET:  # byte counts (a plugin answering None for a
                answer = [operator.index(code) for code in answer]  # miss failed the caller)
        except Exception as exc:  # a backend failure fails this call only
            self._breaker_outcome(operation, ok=False)
            return None, self._backend_failed(operation, pool, exc)
        except BaseException:  # an interrupt: no outcome would leave a trial call claimed for good
            self._breaker_outcome(operation, ok=False)
            raise
        self._breaker_outcome(operation, ok=True)
        return answer, None

    def _remove_rejected(self, pool: str, rejected: Mapping[Verdict, Sequence[str]]) -> None:
        """Drop objects that failed verification, where the backend can remove (one call)."""
        if not self._removable:
            return
        if self.keep_foreign:
            rejected = {verdict: keys for verdict, keys in rejected.items() if verdict not in FOREIGN}
            if not rejected:
                return
        keys = [key for keys in rejected.values() for key in keys]
        is_foreign = [verdict in FOREIGN for verdict, keys in rejected.items() for _ in keys]
        removed, _error = self._call_backend(StorageOperation.REMOVE, pool, keys)
        if removed is None:
            removed = [False] * len(keys)
        counts = dict.fromkeys(
            ("corrupt_removed", "corrupt_remove_failed", "foreign_removed", "foreign_remove_failed"), 0
        )
        for gone, foreign in zip(removed, is_foreign, strict=True):
            kind = "foreign" if foreign else "corrupt"
            counts[f"{kind}_removed" if gone else f"{kind}_remove_failed"] += 1
        self._count(**counts)

    def refused(self, operation: StorageOperation, count: int) -> BatchResult:
        """The answer to an ``exists`` / ``put`` / ``get`` of ``count`` units that the open breaker
        refuses before any work (``breaker(operation).refusing()``), counted as the refused call would be:
        callers that prepare a call (the writer's batches) skip that work too."""
        error = self._refused(operation)
        if operation == StorageOperation.PUT:
            self._count(put_units=count, put_failed=count)
        elif operation == StorageOperation.GET:
            self._count(get_units=count, get_misses=count)
        else:
            self._count(exists_calls=1)
        return BatchResult([False] * count, error, failed=count, transient=True)

    def _refused(self, operation: StorageOperation) -> str:
        """Count a call the open breaker refused, and say why."""
        self._count(breaker_rejected=1)
        breaker = self.breaker(operation)
        return (
            f"{operation} on backend {self.backend.instance!r} refused: circuit breaker open after "
            f"repeated {_direction(operation)} failures (a trial call goes through every "
            f"{breaker.cooldown_s:g} s)"
        )

    def _breaker_outcome(self, operation: StorageOperation, *, ok: bool) -> None:
        breaker = self.breaker(operation)
        changed = breaker.record(ok)
        direction = _direction(operation)
        if changed is BreakerState.OPEN:
            self._count(breaker_trips=1)
            log.warning(
                "backend %r failed %d %s calls in a row: circuit breaker open, %s fail at once for %g s "
                "(L1/L2 keep serving)",
                self.backend.instance,
                breaker.failures,
                direction[:-1],
                direction,
                breaker.cooldown_s,
            )
        elif changed is BreakerState.CLOSED:
            instance = self.backend.instance
            log.warning("backend %r answered %s again: circuit breaker closed", instance, direction)


def _direction(operation: StorageOperation) -> str:
    """'reads' or 'writes': which of an engine's two breakers an operation goes through."""
    return "writes" if operation in _WRITES else "reads"
