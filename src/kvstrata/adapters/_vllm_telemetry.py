"""What kvstrata's vLLM connector tells vLLM: transfer counters and KV cache events.

* :class:`KvstrataConnectorStats` -- counters per interval (lookups, blocks hit, loaded, saved,
  failed loads, bytes, damaged and foreign objects), summed over workers and the scheduler by
  vLLM and logged with its other stats (``reduce``).
* :class:`EventLog` -- vLLM KV events for a KV-aware router: ``BlockStored`` for every block the
  connector stores and ``BlockRemoved`` for blocks it found unusable (a failed load: the damaged
  objects were removed), with ``medium="STORAGE"`` (kvstrata's L3), keyed by kvstrata's own block
  hashes (stable across processes, unlike vLLM's salted ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: vLLM's medium of a storage tier (``vllm.distributed.kv_events.MEDIUM_STORAGE``).
MEDIUM = "STORAGE"
_ENGINE_COUNTERS = (
    "bytes_read",
    "bytes_written",
    "corrupt_detected",
    "foreign_objects",
    "backend_errors",
    "put_failed",
)


@dataclass
class KvstrataConnectorStats(KVConnectorStats):
    """Counters since the last report; ``aggregate`` sums them (workers + scheduler)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvstrataConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"kvstrata_{key}": value for key, value in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDelta:
    """Turns running counters into per-report deltas."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, own: Mapping[str, int], engine_metrics: Any) -> KvstrataConnectorStats | None:
        now = dict(own)
        for name in _ENGINE_COUNTERS:
            now[name] = int(getattr(engine_metrics, name, 0))
        delta = {key: value - self._last.get(key, 0) for key, value in now.items()}
        self._last = now
        stats = KvstrataConnectorStats(data={key: value for key, value in delta.items() if value})
        return None if stats.is_empty() else stats


class KvstrataKVEvents(KVConnectorKVEvents):
    """The KV events of one worker's saves and loads, as vLLM carries them to the scheduler,
    summed over the workers: ``BlockStored`` counts once every rank published it (a block is
    announced only when every TP rank stored its shard), ``BlockRemoved`` once any rank did (a
    block one rank lost is served by none)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> KvstrataKVEvents:
        common = [e for e in self._aggregator.get_common_events() if not isinstance(e, BlockRemoved)]
        removed = [e for e in dict.fromkeys(self._aggregator.get_all_events()) if isinstance(e, BlockRemoved)]
        self._aggregator.clear_events()
        self._aggregator.add_events(common + removed)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


class EventLog:
    """KV events collected by the scheduler role, drained by vLLM each step (``take_events``)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, hashes: list[str], parent: str | None, tokens: list[int]) -> None:
        if hashes:
            self._events.append(
                BlockStored(
                    block_hashes=[bytes.fromhex(h) for h in hashes],
                    parent_block_hash=bytes.fromhex(parent) if parent else None,
                    token_ids=list(tokens),
                    block_size=self.block_size,
                    lora_id=None,
                    medium=MEDIUM,
                    lora_name=None,
                )
            )

    def removed(self, hashes: list[str]) -> None:
        if hashes:
            self._events.append(BlockRemoved(block_hashes=[bytes.fromhex(h) for h in hashes], medium=MEDIUM))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def add(self, events: list[KVCacheEvent]) -> None:
        """Events the workers published (see :class:`KvstrataKVEvents`)."""
        self._events.extend(events)
