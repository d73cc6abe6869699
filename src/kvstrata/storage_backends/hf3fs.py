"""``hf3fs``: DeepSeek 3FS through its USRBIO API -- a STUB until a 3FS mount is available.

What is real here: the capability declaration, the availability check (``hf3fs_fuse.io`` must
import AND ``extract_mount_point(path)`` must find a 3FS mount, else ``unavailable_reason`` says
why and ``open`` raises :class:`PluginUnavailableError`), and the *mock* mode (``mock: true``),
which keeps the backend's code path tested: one preallocated ordinary file cut into fixed-size
slots, an in-memory key -> slot map (the role 3FS's metadata service plays), positioned vectored
I/O (``os.pwritev`` / ``os.preadv``) per object, LRU slot reuse when full. A slot being read is
pinned: it is neither reused for another key nor freed until its readers are done, so a read can
never return bytes another key wrote meanwhile.

What is NOT implemented: the USRBIO data path (shared-memory iovecs, io rings) and the metadata
server. Even with a mount present, ``open`` refuses with a message saying so.

The mock's map lives in the process, so mock objects are neither persistent nor shared between
processes; the declared capabilities describe this implementation, not a future 3FS one.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from kvstrata.plugins.errors import PluginUnavailableError
from kvstrata.plugins.storage_backend import (
    ANY_POOL,
    BackendCapabilities,
    BackendConfig,
    PoolCapabilities,
    StorageBackend,
    StorageObject,
    StoragePath,
    leading_regions,
    object_views,
    region_views,
)

MISS = -1
#: why a real (non-mock) 3FS config cannot open
STUB = "hf3fs is a stub: the USRBIO data path is not implemented; use mock: true"


class HF3FSConfig(BackendConfig):
    """Config of the ``hf3fs`` backend."""

    type: Literal["hf3fs"] = "hf3fs"
    path: StoragePath = Field(description="directory on a 3FS mount (mock: any directory)")
    mock: bool = Field(default=False, description="use an ordinary preallocated file instead of USRBIO")
    file_bytes: int = Field(default=1 << 30, ge=4096, description="size of the preallocated data file")
    slot_bytes: int = Field(default=4 << 20, ge=128, description="fixed slot per object (max object size)")

    @model_validator(mode="after")
    def _holds_a_slot(self) -> HF3FSConfig:
        if self.slots < 1:  # it opened, and every put failed
            raise ValueError(
                f"file_bytes ({self.file_bytes}) holds no slot of slot_bytes ({self.slot_bytes}): "
                "raise file_bytes or lower slot_bytes"
            )
        return self

    @property
    def slots(self) -> int:
        return self.file_bytes // self.slot_bytes


def _usrbio_problem(path: Path | None) -> str | None:
    """Why USRBIO cannot be used (``None`` when the module imports and ``path`` is on 3FS)."""
    try:
        usrbio = importlib.import_module("hf3fs_fuse.io")
    except ImportError as exc:
        return (
            f"module hf3fs_fuse.io cannot be imported ({exc}): it ships with a 3FS deployment (built in "
            "3FS's dev container), not on PyPI; set mock: true to use the file-backed mock"
        )
    if path is not None and usrbio.extract_mount_point(str(path)) is None:
        return f"{path} is not on a 3FS mount (extract_mount_point returned None)"
    return None


class HF3FSBackend(StorageBackend):
    name = "hf3fs"
    Config = HF3FSConfig
    capabilities = BackendCapabilities(
        # USRBIO moves data through its own shared-memory iovecs, so the core stages (copy path).
        pools={ANY_POOL: PoolCapabilities(zero_copy=False)},
        batch_exists=True,
        multi_buffer_objects=True,
        atomic_visibility=True,  # a key is mapped only after its slot is fully written
        overwrite="skip_existing",
        persistent=False,  # mock: the key map is in memory
        shared_across_instances=False,
        self_evicting=True,  # LRU slot reuse
        removable=True,
    )

    config: HF3FSConfig

    def __init__(self, instance: str, config: BackendConfig) -> None:
        super().__init__(instance, config)
        # The slot size bounds objects: the instance narrows the class declaration for the planner.
        self.capabilities = type(self).capabilities.model_copy(
            update={"max_object_bytes": self.config.slot_bytes}
        )
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._slots: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (slot, length), LRU
        self._free: list[int] = []
        self._pins: dict[int, int] = {}  # slot -> readers reading it now (outside the lock)
        self._retired: set[int] = set()  # unmapped while pinned: freed by the last reader
        self._token = uuid.uuid4().hex[:12]

    @classmethod
    def unavailable_reason(cls, config: BackendConfig | None = None) -> str | None:
        if isinstance(config, HF3FSConfig):
            if config.mock:
                return None
            problem = _usrbio_problem(config.path)
            return problem or STUB
        # the listing (``kvstrata plugins``): on a 3FS machine, where USRBIO imports, no config
        # but ``mock: true`` opens, so the stub is not "available" there either
        return _usrbio_problem(None) or STUB

    @property
    def data_file(self) -> Path:
        # One file per backend object: the key map is private to it, so must be the data.
        return Path(self.config.path) / f"hf3fs-mock.{self.instance}.{os.getpid()}.{self._token}.bin"

    def open(self) -> None:
        reason = self.unavailable_reason(self.config)
        if reason is not None:
            raise PluginUnavailableError(f"storage backend {self.instance!r} (hf3fs): {reason}")
        if self._fd is not None:
            raise RuntimeError(f"hf3fs backend {self.instance!r} is already open")
        self.config.path.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.data_file, os.O_RDWR | os.O_CREAT, 0o644)  # close() undoes it all
        try:
            os.ftruncate(self._fd, self.config.slots * self.config.slot_bytes)
        except OSError:
            self.close()  # no descriptor or data file left behind (a file past the filesystem's limit)
            raise
        self._free = list(range(self.config.slots - 1, -1, -1))
        self._slots.clear()
        self._pins.clear()
        self._retired.clear()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            with contextlib.suppress(FileNotFoundError):
                self.data_file.unlink()  # the map dies with the process, so does the data

    def probe(self) -> str | None:
        return self.unavailable_reason(self.config)

    def _require_fd(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"hf3fs backend {self.instance!r} is not open")
        return self._fd

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            found = [key in self._slots for key in keys]
            for key, present in zip(keys, found, strict=True):
                if present:
                    self._slots.move_to_end(key)  # an existence query is a use: keep it in LRU
            return found

    def _allocate(self) -> int | None:
        """A slot to write: a free one, else the least recently used one nobody is reading."""
        with self._lock:
            if self._free:
                return self._free.pop()
            victim = next((key for key, (slot, _) in self._slots.items() if slot not in self._pins), None)
            if victim is None:
                return None
            slot, _length = self._slots.pop(victim)
            return slot

    def _release_slot(self, slot: int) -> None:
        """Give an unmapped slot back; if readers still hold it, the last one frees it. Lock held."""
        if slot in self._pins:
            self._retired.add(slot)
        else:
            self._free.append(slot)

    def _unpin(self, slot: int) -> None:
        with self._lock:
            readers = self._pins[slot] - 1
            if readers:
                self._pins[slot] = readers
                return
            del self._pins[slot]
            if slot in self._retired:
                self._retired.discard(slot)
                self._free.append(slot)

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        fd = self._require_fd()
        results: list[bool] = []
        for obj in objects:
            with self._lock:
                if obj.key in self._slots:
                    self._slots.move_to_end(obj.key)
                    results.append(True)
                    continue
            nbytes = obj.nbytes
            if nbytes > self.config.slot_bytes:
                results.append(False)
                continue
            slot = self._allocate()
            if slot is None:
                results.append(False)
                continue
            try:
                written = os.pwritev(fd, object_views(obj), slot * self.config.slot_bytes)
                if written != nbytes:
                    raise OSError(f"short write {written}/{nbytes}")
            except OSError:
                with self._lock:
                    self._free.append(slot)
                results.append(False)
                continue
            with self._lock:
                if obj.key in self._slots:  # another thread won: keep its slot
                    self._free.append(slot)
                else:
                    self._slots[obj.key] = (slot, nbytes)
            results.append(True)
        return results

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        fd = self._require_fd()
        results: list[int] = []
        for obj in objects:
            with self._lock:
                entry = self._slots.get(obj.key)
                if entry is not None:
                    self._slots.move_to_end(obj.key)
                    self._pins[entry[0]] = self._pins.get(entry[0], 0) + 1  # not reused while read
            if entry is None:
                results.append(MISS)
                continue
            slot, length = entry
            views = region_views(leading_regions(obj.regions, length))
            try:
                results.append(os.preadv(fd, views, slot * self.config.slot_bytes))
            except OSError as exc:
                results.append(-(exc.errno or 1))
            finally:
                self._unpin(slot)
        return results

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Unmap keys and free their slots (an absent key counts as removed)."""
        with self._lock:
            for key in keys:
                entry = self._slots.pop(key, None)
                if entry is not None:
                    self._release_slot(entry[0])
        return [True] * len(keys)

    # --- test hooks -----------------------------------------------------------------------------

    def corrupt_for_test(self, key: str, mode: Literal["flip", "truncate"], offset: int = -1) -> bool:
        """Damage a stored object on purpose (conformance kit): flip one byte or shorten it."""
        fd = self._require_fd()
        with self._lock:
            entry = self._slots.get(key)
            if entry is None:
                return False
            slot, length = entry
            if mode == "truncate":
                self._slots[key] = (slot, length // 2)
                return True
        position = slot * self.config.slot_bytes + (offset % length)
        byte = os.pread(fd, 1, position)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), position)
        return True
