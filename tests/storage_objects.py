"""Storage objects over Python bytearrays for the file backend's tests."""

from __future__ import annotations

import ctypes

from kvstrata.plugins.storage_backend import OBJECT_MAGIC, BufferRegion, StorageObject


class Blobs:
    """Objects over bytearrays that start with the object magic (the backend adopts only those)."""

    def __init__(self) -> None:
        self._keep: list[object] = []

    def obj(self, key: str, data: bytes) -> StorageObject:
        buffer = bytearray(OBJECT_MAGIC + data)
        view = (ctypes.c_ubyte * len(buffer)).from_buffer(buffer)
        self._keep += [buffer, view]
        return StorageObject(key, (BufferRegion(ctypes.addressof(view), len(buffer)),))

    def target(self, key: str, nbytes: int) -> tuple[StorageObject, bytearray]:
        buffer = bytearray(nbytes)
        view = (ctypes.c_ubyte * nbytes).from_buffer(buffer)
        self._keep += [buffer, view]
        return StorageObject(key, (BufferRegion(ctypes.addressof(view), nbytes),)), buffer
