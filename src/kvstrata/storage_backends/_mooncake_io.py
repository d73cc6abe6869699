"""The ``mooncake`` backend's data path: existence, put, get (with the re-reads of objects still
being written and of short objects), remove, and the one place every store call goes through."""

from __future__ import annotations

import collections
import ctypes
import time
from collections.abc import Sequence
from typing import Any, Literal

from kvstrata.plugins.errors import StorageError
from kvstrata.plugins.storage_backend import BufferRegion, StorageObject, leading_regions
from kvstrata.storage_backends._mooncake_memory import MooncakeMemory
from kvstrata.storage_backends._mooncake_protocol import (
    INVALID_PARAMS,
    NOT_READY_BACKOFF_S,
    OBJECT_NOT_FOUND,
    REPLICA_NOT_READY,
    STAGING_TOO_SMALL,
    TRANSFER_FAIL,
    outage_code,
)


class MooncakeIO(MooncakeMemory):
    """The I/O part of ``MooncakeBackend`` (a base class: the backend is one object)."""

    code_counts: collections.Counter[int]
    _rpc_failing: bool

    def probe(self) -> str | None:
        raise NotImplementedError

    @property
    def _endpoint(self) -> tuple[str, str]:
        raise NotImplementedError

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per-key presence. A negative code for one key counts as absent; when *every* key fails
        the backend itself is failing (master unreachable: ``-900``), which raises StorageError so
        the core does not mistake an outage for a cold cache."""
        if not keys:
            return []
        codes = self._call("batch_is_exist", list(keys))
        failed = [code for code in codes if code < 0]
        if failed:
            self.code_counts.update(failed)
            if len(failed) == len(codes):
                raise StorageError(
                    f"mooncake backend {self.instance!r}: batch_is_exist failed for all "
                    f"{len(codes)} keys (code {failed[0]})"
                )
        return [code == 1 for code in codes]

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        """Store objects; an existing key is left as it is (counts as stored); ``-200`` = not stored."""
        results = [False] * len(objects)
        for indexes, ptrs, sizes, staged in self._plan_batches(objects):
            with self._staging_guard(staged):
                for _, scratch, source, nbytes, _offset in staged:
                    ctypes.memmove(scratch, source, nbytes)
                codes = self._transfer("put", [objects[i].key for i in indexes], ptrs, sizes)
            for index, code in zip(indexes, codes, strict=True):
                results[index] = code == 0
                if code != 0:
                    self.code_counts[code] += 1
        return results

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        """Read objects into their regions; per key the bytes read, or the negative Mooncake code.

        A key named twice in one batch is read once per occurrence, in separate calls: Mooncake
        fills only the last target of a repeated key yet reports a full read for each (the first
        then held stale bytes, which the engine counted as damage and removed from the store)."""
        rounds: list[list[int]] = []  # round r: the r-th occurrence of each key
        seen: dict[str, int] = {}
        for index, obj in enumerate(objects):
            occurrence = seen[obj.key] = seen.get(obj.key, -1) + 1
            if occurrence == len(rounds):
                rounds.append([])
            rounds[occurrence].append(index)
        if len(rounds) <= 1:
            return self._get_distinct(objects)
        results = [0] * len(objects)
        for indexes in rounds:
            for index, code in zip(indexes, self._get_distinct([objects[i] for i in indexes]), strict=True):
                results[index] = code
        return results

    def _get_distinct(self, objects: Sequence[StorageObject]) -> list[int]:
        """``get`` of a batch naming each key once.

        ``-703`` (the replica is still being written, typically by a concurrent put of the same key
        whose second writer was already told "stored") is re-read after short waits, so a put that
        returned True is readable; only if it persists does the key report ``-703`` (a miss).

        An object shorter than its regions (truncated or foreign) makes Mooncake's multi-buffer
        read fail as a whole (``-800``); it is then re-read into the leading bytes of the regions so
        the caller sees a short read it can count as corruption, rather than an unexplained error.
        """
        results = self._get(objects)
        for delay in NOT_READY_BACKOFF_S:
            pending = [index for index, code in enumerate(results) if code == REPLICA_NOT_READY]
            if not pending:
                break
            time.sleep(delay)
            for index, code in zip(pending, self._get([objects[i] for i in pending]), strict=True):
                results[index] = code
        short = [
            index
            for index, code in enumerate(results)
            if code == TRANSFER_FAIL and len(objects[index].regions) > 1
        ]
        if short:
            with self._store_call() as store:
                sizes = [int(store.get_size(objects[index].key)) for index in short]
            retry = [
                (index, StorageObject(objects[index].key, leading_regions(objects[index].regions, size)))
                for index, size in zip(short, sizes, strict=True)
                if 0 < size < objects[index].nbytes
            ]
            if retry:
                codes = self._get([obj for _, obj in retry])
                for (index, _), code in zip(retry, codes, strict=True):
                    results[index] = code
        longer = [index for index, code in enumerate(results) if code == INVALID_PARAMS]
        if longer:
            with self._store_call() as store:
                sizes = [int(store.get_size(objects[index].key)) for index in longer]
            for index, size in zip(longer, sizes, strict=True):
                if size > objects[index].nbytes:
                    results[index] = self._read_longer(objects[index], size)
        return results

    def _read_longer(self, obj: StorageObject, size: int) -> int:
        """An object longer than its regions (another layout under our key; Mooncake refuses
        the read): read whole into scratch memory, its leading bytes into the regions, and report
        its length, so the caller's verification classifies it (and can replace it) instead of
        meeting the same unexplained miss on every read -- and, since a put leaves an existing key
        as it is, the page could never be stored again. Where Mooncake reads only registered
        memory (standalone, RDMA) the scratch goes through the staging area like any unregistered
        region; one larger than the area stays that miss."""
        scratch = ctypes.create_string_buffer(size)
        [code] = self._get([StorageObject(obj.key, (BufferRegion(ctypes.addressof(scratch), size),))])
        if code < 0:
            return code
        offset = 0
        for region in obj.regions:
            ctypes.memmove(region.ptr, ctypes.addressof(scratch) + offset, region.nbytes)
            offset += region.nbytes
        return size

    def _get(self, objects: Sequence[StorageObject]) -> list[int]:
        results = [STAGING_TOO_SMALL] * len(objects)
        for indexes, ptrs, sizes, staged in self._plan_batches(objects):
            with self._staging_guard(staged):
                codes = self._transfer("get", [objects[i].key for i in indexes], ptrs, sizes)
                for position, scratch, target, nbytes, offset in staged:
                    # only what was read: past a short object the staging area holds the bytes
                    # of earlier transfers (other keys'), which the target must never receive
                    read = min(nbytes, codes[position] - offset)
                    if read > 0:
                        ctypes.memmove(target, scratch, read)
            for index, code in zip(indexes, codes, strict=True):
                results[index] = code
                if code < 0:
                    self.code_counts[code] += 1
        return results

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Forced ``batch_remove``: a reader's lease (held for a while after every get) must not keep
        a damaged object alive. ``-704`` (already gone) counts as removed."""
        if not keys:
            return []
        codes = self._call("batch_remove", list(keys), True)
        if len(codes) != len(keys):
            raise StorageError(
                f"mooncake backend {self.instance!r}: batch_remove answered {len(codes)} codes "
                f"for {len(keys)} keys"
            )
        self.code_counts.update(code for code in codes if code not in (0, OBJECT_NOT_FOUND))
        return [code in (0, OBJECT_NOT_FOUND) for code in codes]

    def _call(self, method: str, *args: Any) -> list[int]:
        self._live_store()  # not open: fail before probing
        if self._rpc_failing:
            # The last call failed with RPC errors (each costs Mooncake's ~4 s timeout): while the
            # endpoint does not even accept TCP, fail in milliseconds instead.
            reason = self.probe()
            if reason is not None:
                raise StorageError(f"mooncake backend {self.instance!r}: {reason}; failing {method} fast")
        with self._store_call() as store:
            try:
                codes = list(getattr(store, method)(*args))
            except Exception as exc:  # a pybind error fails this operation, never the process
                raise StorageError(f"mooncake backend {self.instance!r}: {method} raised {exc!r}") from exc
        self._rpc_failing = bool(codes) and all(outage_code(code) for code in codes)
        if self._rpc_failing:
            self.code_counts.update(codes)
            role, address = self._endpoint
            raise StorageError(
                f"mooncake backend {self.instance!r}: {method} failed for all {len(codes)} keys "
                f"(code {codes[0]}): {role} {address} unreachable or not answering"
            )
        return codes

    def _transfer(
        self, direction: Literal["put", "get"], keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        if all(len(p) == 1 for p in ptrs):
            flat_ptrs = [p[0] for p in ptrs]
            flat_sizes = [s[0] for s in sizes]
            method = "batch_put_from" if direction == "put" else "batch_get_into"
            codes = self._call(method, keys, flat_ptrs, flat_sizes)
        else:
            method = "batch_put_from_multi_buffers" if direction == "put" else "batch_get_into_multi_buffers"
            codes = self._call(method, keys, ptrs, sizes)
        if len(codes) != len(keys):
            raise StorageError(
                f"mooncake backend {self.instance!r}: {method} answered {len(codes)} codes "
                f"for {len(keys)} keys"
            )
        return codes
