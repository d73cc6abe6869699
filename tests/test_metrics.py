"""The cache's counters: operations named by an enum, the storage engine's counters attached by type.

The names a user sees (``snapshot()`` keys, Prometheus labels) are spelled out here, so renaming a
member of :class:`Operation` or a field of :class:`StorageMetrics` fails a test instead of
silently renaming a metric.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import kvstrata
from kvstrata.core.metrics import CacheMetrics, Operation
from kvstrata.core.storage_metrics import StorageMetrics, StorageOperation

OPERATION_NAMES = [
    "backups",
    "backups_waited",
    "backups_skipped",
    "load_backs",
    "storage_writes",
    "storage_writes_abandoned",
    "prefetches_started",
    "prefetches_committed",
    "prefetches_dropped",
    "prefetches_revoked",
    "prefetches_skipped",
    "host_admitted",
    "host_rejected",
    "storage_admitted",
    "storage_rejected",
    "pins_refused",
    "out_of_window_device",
    "out_of_window_host",
]

STORAGE_COUNTERS = [
    "exists_calls",
    "put_units",
    "put_failed",
    "put_skipped_read_only",
    "get_units",
    "get_hits",
    "get_misses",
    "corrupt_detected",
    "corrupt_removed",
    "corrupt_remove_failed",
    "foreign_objects",
    "foreign_removed",
    "foreign_remove_failed",
    "reread_cleared",
    "backend_errors",
    "breaker_trips",
    "breaker_rejected",
    "bytes_written",
    "bytes_read",
]


def test_operations_keep_their_names_as_plain_strings_in_the_snapshot() -> None:
    metrics = CacheMetrics()
    metrics.count(Operation.BACKUPS, 2)
    metrics.count(Operation.out_of_window("host"), 5)
    operations = metrics.snapshot()["operations"]
    assert list(operations) == OPERATION_NAMES
    assert all(type(name) is str for name in operations)  # JSON and exporters see the names
    assert operations["backups"] == 2 and operations["out_of_window_host"] == 5
    assert json.loads(json.dumps(operations)) == operations


def test_an_unknown_operation_is_refused() -> None:
    metrics = CacheMetrics()
    with pytest.raises(KeyError):
        metrics.count("backup")  # type: ignore[arg-type]  # a typo must not open a new counter
    with pytest.raises(ValueError):
        Operation.out_of_window("storage")


def test_storage_counters_are_attached_by_type() -> None:
    metrics = CacheMetrics()
    assert metrics.snapshot()["storage"] == {} and metrics.corrupt_detected == 0
    storage = StorageMetrics()
    metrics.attach(storage)
    storage.put_units += 3
    storage.record_get(4, 1, 100, {"checksum": 2}, {"layout": 1})
    snap = metrics.snapshot()
    assert list(snap["storage"]) == STORAGE_COUNTERS  # the reason breakdowns are not counters
    assert snap["storage"]["put_units"] == 3 and snap["storage"]["get_misses"] == 3
    assert snap["corrupt_detected"] == metrics.corrupt_detected == 2
    assert snap["storage"]["foreign_objects"] == 1


def test_storage_operations_name_the_backend_methods() -> None:
    from kvstrata.plugins.storage_backend import StorageBackend

    for operation in StorageOperation:
        assert callable(getattr(StorageBackend, operation)), operation


def _core_imports(name: str) -> set[str]:
    path = Path(kvstrata.__file__).parent / "core" / f"{name}.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # TYPE_CHECKING imports included
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvstrata.core."):
            found.add(node.module.removeprefix("kvstrata.core."))
    return found


def test_the_storage_counters_import_neither_the_engine_nor_its_calls() -> None:
    """``StorageMetrics`` has its own module: the engine, its guarded calls and the cache's
    metrics all point at it, and nothing there points back at the engine (no import circle)."""
    assert _core_imports("storage_metrics") == set()
    assert "storage_engine" not in _core_imports("backend_calls")
    assert "storage_engine" not in _core_imports("metrics")
